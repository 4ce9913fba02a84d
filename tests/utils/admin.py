"""Logged-in admin clients for the admin's tests."""

from __future__ import annotations

from django.contrib.auth.models import Permission, User
from django.test import Client


def superuser_client() -> Client:
    """A client logged in as a superuser, ``root``."""
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def staff_client(username: str, *codenames: str) -> Client:
    """A client logged in as a staff user with the outbox's permissions ``codenames``
    (``view_outboxevent``, ``change_outboxevent``, ...)."""
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(codename=codename, content_type__app_label="django_outbox")
        )
    client = Client()
    client.force_login(user)
    return client
