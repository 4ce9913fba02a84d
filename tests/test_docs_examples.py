"""The documentation's examples, run as a reader runs them: the wheel installed into a
brand-new Django project that follows docs/installation.md step by step, against real
PostgreSQL and RabbitMQ.

Marked ``packaging``: scripts/test runs it once (in its SQLite pass), the tox cells leave it
out.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from urllib.parse import unquote, urlparse

import pytest
from packaging.version import Version

from tests.utils.packaging import ROOT, python_for_the_newest_django, run

INSTALLATION = ROOT / "docs" / "installation.md"

pytestmark = [pytest.mark.once, pytest.mark.packaging]


def _documented(text: str) -> str:
    """A line the installation guide gives, verbatim: the test does what a reader would."""
    assert text in INSTALLATION.read_text(), f"docs/installation.md no longer says {text!r}"
    return text


def _first_event_snippet() -> str:
    text = INSTALLATION.read_text()
    section = text[text.index("## A first event") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
@pytest.mark.amqp
def test_the_wheel_in_a_new_project_migrates_checks_and_relays_to_rabbitmq(
    dist, tmp_path, amqp_url, fresh_database
):
    import pika

    # pip install, into a fresh virtualenv: pip takes the newest Django our range admits.
    venv = tmp_path / "venv"
    run([python_for_the_newest_django(), "-m", "venv", venv])
    python = venv / "bin" / "python"
    _documented("pip install 'django-transactional-outbox[postgres]'")
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

    # django-admin startproject, then the settings the guide gives.
    project = tmp_path / "shop"
    project.mkdir()
    run([venv / "bin" / "django-admin", "startproject", "shop", project])
    settings = project / "shop" / "settings.py"
    text = settings.read_text()
    apps_end = text.index("\n]", text.index("INSTALLED_APPS = ["))
    _documented('    "django_outbox",\n]')
    text = text[:apps_end] + '\n    "django_outbox",' + text[apps_end:]
    url = urlparse(fresh_database)
    exchange = f"outbox-wheel-test-{uuid.uuid4().hex[:8]}"
    text += "\n".join(
        [
            "",
            _documented("import os"),
            _documented('OUTBOX_BROKER_URL = os.environ["AMQP_URL"]'),
            # The guide's exchange is "outbox"; the test's broker is shared, so a name of its own.
            _documented('OUTBOX_EXCHANGE = "outbox"').replace('"outbox"', f'"{exchange}"'),
            "DATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql', "
            f"'NAME': {url.path.lstrip('/')!r}, 'USER': {unquote(url.username or '')!r}, "
            f"'PASSWORD': {unquote(url.password or '')!r}, 'HOST': {url.hostname!r}, "
            f"'PORT': {url.port or 5432!r}}}}}",
            # What any project sets before `check --deploy`; Django's own findings about the
            # rest (HSTS, secure cookies) are warnings and not ours.
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

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV", "DATABASE_URL"}
    }
    env["AMQP_URL"] = amqp_url

    def manage(*args: str) -> subprocess.CompletedProcess[str]:
        return run([python, "manage.py", *args], cwd=project, env=env)

    manage(*_documented("python manage.py migrate").split()[2:])
    check = manage(*_documented("python manage.py check --deploy --database default").split()[2:])
    assert "django_outbox." not in check.stdout + check.stderr

    # The guide's first event, verbatim, in `manage.py shell`.
    manage("shell", "-c", _first_event_snippet())
    row = json.loads(
        manage(
            "shell",
            "-c",
            "import json; from django_outbox.models import OutboxEvent; "
            "e = OutboxEvent.objects.get(); "
            "print(json.dumps([e.event_id, e.event_type, e.status]))",
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    event_id, event_type, status = row
    assert (event_type, status) == ("ORDER_CREATED", 0)

    # A consumer's queue, bound before the relay publishes (mandatory: else it comes back).
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.exchange_declare(exchange, exchange_type="topic", durable=True)
        queue = channel.queue_declare("", exclusive=True).method.queue
        channel.queue_bind(queue, exchange, routing_key=event_type)

        manage(*_documented("python manage.py publish_outbox --once").split()[2:])

        method, properties, body = channel.basic_get(queue, auto_ack=True)
        assert method is not None, "no message reached the bound queue"
        assert properties.message_id == event_id
        assert properties.type == "ORDER_CREATED"
        assert properties.delivery_mode == 2  # persistent
        assert json.loads(body) == {"order_id": 42}
        channel.exchange_delete(exchange)
    finally:
        connection.close()

    status = (
        manage(
            "shell",
            "-c",
            "from django_outbox.models import OutboxEvent; print(OutboxEvent.objects.get().status)",
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    assert status == "1"  # SENT
