# Sourced by .ci/run and scripts/test. The supported Pythons (3.10-3.13) each answer to their
# own name (python3.12, ...) so that tox finds them, and `python3` is the newest of them.
#
# pyenv's shims answer python3.12 only while 3.12 is selected; select every 3.10-3.13 it
# has, newest first (the newest patch release of each). Without pyenv, whatever PATH has.
if command -v pyenv >/dev/null 2>&1; then
  _outbox_pythons=$(
    pyenv versions --bare --skip-aliases 2>/dev/null |
      grep -E '^3\.1[0-3]\.[0-9]+$' |
      sort -t. -k2,2nr -k3,3nr |
      awk -F. '!seen[$2]++' |
      paste -sd: -
  ) || true
  if [ -n "$_outbox_pythons" ]; then
    export PYENV_VERSION="$_outbox_pythons${PYENV_VERSION:+:$PYENV_VERSION}"
  fi
  unset _outbox_pythons
fi
