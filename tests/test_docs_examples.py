"""The documentation's story, run as a reader runs it (issue 28, item 1).

README, docs/installation.md, docs/writing-events.md and docs/consumers.md tell one story:
an ``orders`` app saves an order and emits ``ORDER_CREATED``, a ``points`` app consumes it
and awards points, once. The code is taken from the Markdown itself: every ``python`` block
whose first line names a file (``# orders/services.py``) is that file, and a file shown in
several places must read the same everywhere; ``# settings.py`` blocks are added to the
project's settings; the ``# python manage.py shell`` block runs in the shell; the commands
are the documented lines. They go into a brand-new ``django-admin startproject`` with the
built wheel installed in a fresh virtualenv (pip picks the newest Django the package
admits), against real PostgreSQL and RabbitMQ: the event is emitted, relayed, consumed
once, then replayed and taken as a duplicate. A doc edit that breaks the story fails here.

Marked ``packaging``: scripts/test runs it once (in its SQLite pass), the tox cells leave it
out.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from packaging.version import Version

from tests.utils.packaging import ROOT, python_for_the_newest_django, run

DOCS = {
    "README.md": ROOT / "README.md",
    "installation.md": ROOT / "docs" / "installation.md",
    "writing-events.md": ROOT / "docs" / "writing-events.md",
    "consumers.md": ROOT / "docs" / "consumers.md",
}
INSTALLATION = DOCS["installation.md"]
SHELL = "# python manage.py shell"
#: The story's apps: a block whose first line names a file in one of them is that file.
STORY_APPS = ("orders/", "points/")

pytestmark = [pytest.mark.once, pytest.mark.packaging]


def python_blocks(path: Path) -> list[str]:
    """The ``python`` code blocks of a Markdown file, in order."""
    return re.findall(r"^```python\n(.*?)^```$", path.read_text(), flags=re.M | re.S)


def story() -> tuple[dict[str, str], list[str], str]:
    """The story's files by path, its settings blocks (in the order a reader meets them)
    and its shell block, from the documents themselves."""
    files: dict[str, tuple[str, str]] = {}  # path -> (code, where it was first shown)
    settings: list[str] = []
    shell = ""
    for doc in ("installation.md", "writing-events.md", "consumers.md", "README.md"):
        for block in python_blocks(DOCS[doc]):
            first = block.split("\n", 1)[0]
            if first == SHELL:
                shell = block
                continue
            path = first.removeprefix("# ")
            if path != "settings.py" and not path.startswith(STORY_APPS):
                continue  # an illustration, not a file of the story
            if path == "settings.py":
                if doc == "README.md":
                    assert block in settings, (
                        f"README.md's settings differ from the guide's:\n{block}"
                    )
                elif block not in settings:
                    settings.append(block)
                continue
            if path in files:
                code, where = files[path]
                assert block == code, f"{doc} shows {path} otherwise than {where} does"
            else:
                files[path] = (block, doc)
    return {path: code for path, (code, _) in files.items()}, settings, shell


def documented(doc: Path, text: str) -> str:
    """A line the documentation gives, verbatim: the test does what a reader would."""
    assert text in doc.read_text(), f"{doc.name} no longer says {text!r}"
    return text


def command(doc: Path, line: str) -> list[str]:
    """The arguments of a documented ``python manage.py ...`` line."""
    return documented(doc, line).split()[2:]


@pytest.mark.once
def test_the_story_names_the_same_files_the_same_way_everywhere():
    files, settings, shell = story()
    assert {
        "orders/models.py",
        "orders/services.py",
        "points/models.py",
        "points/handlers.py",
    } <= set(files)
    assert len(settings) == 2 and shell
    # The README shows the story's services and handler as the guides do.
    readme = "\n".join(python_blocks(DOCS["README.md"]))
    assert files["orders/services.py"] in readme and files["points/handlers.py"] in readme


@pytest.mark.slow
@pytest.mark.amqp
def test_the_story_runs_in_a_new_project_from_the_wheel(dist, tmp_path, amqp_url, fresh_database):
    import pika

    files, settings_blocks, shell = story()

    # pip install, into a fresh virtualenv: pip takes the newest Django our range admits.
    venv = tmp_path / "venv"
    run([python_for_the_newest_django(), "-m", "venv", venv])
    python = venv / "bin" / "python"
    documented(INSTALLATION, "pip install 'django-transactional-outbox[postgres]'")
    run([python, "-m", "pip", "install", "-q", f"{dist.wheel}[postgres]"])
    newest = max(
        (
            c.rsplit(" :: ", 1)[1]
            for c in dist.metadata().get_all("Classifier") or []
            if c.startswith("Framework :: Django ::")
        ),
        key=Version,
    )
    django_version = run([python, "-c", "import django; print(django.__version__)"]).stdout
    assert django_version.startswith(f"{newest}."), django_version

    # django-admin startproject and the two apps; their files as the documents show them.
    project = tmp_path / "shop"
    project.mkdir()
    run([venv / "bin" / "django-admin", "startproject", "shop", project])
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV", "DATABASE_URL"}
    }
    env.pop("AMQP_URL", None)

    def manage(*args: str, check: bool = True, **extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(python), "manage.py", *args]
        if check:
            return run(cmd, cwd=project, env={**env, **extra})
        return subprocess.run(
            cmd, cwd=project, env={**env, **extra}, capture_output=True, text=True, timeout=300
        )

    for app in ("orders", "points"):
        doc = DOCS["installation.md" if app == "orders" else "consumers.md"]
        manage(*command(doc, f"python manage.py startapp {app}"))
    for path, code in files.items():
        (project / path).write_text(code)

    # The settings: the documents' blocks added to the project's, "..." standing for the
    # apps it has; the apps the story adds; the test's own database, exchange and queue
    # (the servers are shared), and what any project sets before `check --deploy`.
    exchange = f"outbox-docs-test-{uuid.uuid4().hex[:8]}"
    queue = f"{exchange}.points"
    settings = project / "shop" / "settings.py"
    text = settings.read_text()
    for block in settings_blocks:
        block = block.replace(
            "INSTALLED_APPS = [\n    ...,\n", "INSTALLED_APPS = [\n    *INSTALLED_APPS,\n"
        )
        block = block.replace(
            documented(INSTALLATION, 'OUTBOX_EXCHANGE = "outbox"'),
            f"OUTBOX_EXCHANGE = {exchange!r}",
        )
        block = block.replace(
            documented(DOCS["consumers.md"], 'OUTBOX_CONSUMER_QUEUE = "points"'),
            f"OUTBOX_CONSUMER_QUEUE = {queue!r}",
        )
        text += "\n" + block
    url = urlparse(fresh_database)
    text += "\n".join(
        [
            "",
            'INSTALLED_APPS += ["orders", "points"]',
            "DATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql', "
            f"'NAME': {url.path.lstrip('/')!r}, 'USER': {unquote(url.username or '')!r}, "
            f"'PASSWORD': {unquote(url.password or '')!r}, 'HOST': {url.hostname!r}, "
            f"'PORT': {url.port or 5432!r}}}}}",
            "DEBUG = False",
            f"SECRET_KEY = {uuid.uuid4().hex + uuid.uuid4().hex!r}",
            "ALLOWED_HOSTS = ['shop.example.com']",
            "",
        ]
    )
    if "MAILERS" in text:  # Django 6.1's template mails to the console: a deploy-time error
        text += (
            "MAILERS = {'default': {'BACKEND': 'django.core.mail.backends.smtp.EmailBackend'}}\n"
        )
    settings.write_text(text)

    # The settings load whether or not AMQP_URL is exported (it was a KeyError).
    manage("check")
    env["AMQP_URL"] = amqp_url

    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        manage(*command(INSTALLATION, "python manage.py makemigrations orders points"))
        manage(*command(INSTALLATION, "python manage.py migrate"))
        checked = manage(
            *command(INSTALLATION, "python manage.py check --deploy --database default")
        )
        assert "django_outbox." not in checked.stdout + checked.stderr
        manage(*command(INSTALLATION, "python manage.py outbox_check"))

        # The consumer first: it declares its queue and binds it (nothing to handle yet).
        consume = command(INSTALLATION, "python manage.py consume_outbox --once")
        assert manage(*consume).stdout.strip().endswith("0 message(s): none")

        manage("shell", "-c", shell)
        event = _shell_json(
            manage,
            "e = OutboxEvent.objects.get(); print(json.dumps([e.event_type, e.status, e.payload]))",
        )
        assert event == ["ORDER_CREATED", 0, {"order_id": 1, "user_id": 7, "amount": "42.50"}]

        # Relayed, then consumed once: one ledger row.
        publish = command(INSTALLATION, "python manage.py publish_outbox --once")
        assert "sent=1" in manage(*publish).stdout
        assert "processed 1" in manage(*consume).stdout
        assert _ledger(manage) == [[7, 42]]

        # Replayed: the same event again, a duplicate; still one row.
        replay = command(INSTALLATION, "python manage.py outbox_requeue --status sent")
        assert "replayed 1 sent event(s)" in manage(*replay).stdout
        assert "sent=1" in manage(*publish).stdout
        assert "duplicate 1" in manage(*consume).stdout
        assert _ledger(manage) == [[7, 42]]
    finally:
        channel = connection.channel()
        for name in (queue, f"{queue}.dlq"):
            channel.queue_delete(name)
        channel.exchange_delete(exchange)
        connection.close()


def _shell_json(manage, code: str) -> object:
    """What ``code`` prints as JSON in `manage.py shell` (the outbox and the story's models
    imported)."""
    imports = (
        "import json; from django_outbox.models import OutboxEvent; "
        "from points.models import PointsLedger; "
    )
    return json.loads(manage("shell", "-c", imports + code).stdout.strip().splitlines()[-1])


def _ledger(manage) -> object:
    return _shell_json(
        manage, "print(json.dumps(list(PointsLedger.objects.values_list('user_id', 'points'))))"
    )
