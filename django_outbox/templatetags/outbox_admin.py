"""Template filters of the outbox admin's own pages (``{% load outbox_admin %}``)."""

from __future__ import annotations

from collections.abc import Sequence

from django import template
from django.utils.html import format_html_join
from django.utils.safestring import mark_safe

register = template.Library()


@register.filter
def outbox_crumbs(breadcrumbs: str, trail: Sequence[tuple[str, str]]) -> str:
    """The admin's own breadcrumbs with ``trail`` (``(url, label)`` pairs) between Home and
    the page's title: ``{{ block.super|outbox_crumbs:breadcrumb_trail }}``.

    ``block.super`` is ``admin/base.html``'s block, Home and the title, in the markup of
    the Django that renders it: links in a ``<div>`` separated by ``&rsaquo;`` up to 6.0, an
    ``<ol>`` of ``<li>`` from 6.1. The trail is written the same way, so the pages look as
    the admin's own on each release. Markup of neither kind is left as it is (Home, title).
    """
    html = str(breadcrumbs)
    if '<ol class="breadcrumbs">' in html:
        at = html.find("<li aria-current")
        at = at if at >= 0 else html.rfind("</ol>")
        # One per line, as the admin writes them: the space between items is its spacing.
        # One per line, as the admin writes them: the space between items is its spacing.
        items = format_html_join("", '<li><a href="{}">{}</a></li>\n', trail)
        return mark_safe(html[:at] + items + html[at:])  # both parts are escaped
    home = html.find("</a>")
    if '<div class="breadcrumbs">' in html and home >= 0:
        at = home + len("</a>")
        links = format_html_join("", ' &rsaquo; <a href="{}">{}</a>', trail)
        return mark_safe(html[:at] + links + html[at:])  # both parts are escaped
    return breadcrumbs
