"""The outbox in the Django admin: a read-only changelist, triage actions and a dashboard.

Rows are never edited by hand: the relay owns them. What an operator does is triage:
look at the dashboard (the article's three figures and its ``status x retry_count`` table),
find the dead letters, fix the cause, then *requeue* them or *mark* hopeless PENDING rows
DEAD. Both actions need the model's change permission; without it a user sees no actions
and a crafted POST is refused by Django's own action validation.

The dashboard offers "requeue all N" for each event type among the dead letters and each
failure reason, through a confirmation page (change permission, CSRF) that runs
:func:`django_outbox.requeue.requeue`, as ``manage.py outbox_requeue`` does.

The actions call the outbox QuerySet's lifecycle methods
(:meth:`~django_outbox.querysets.OutboxEventQuerySet.requeue` and
:meth:`~django_outbox.querysets.OutboxEventQuerySet.mark_dead`), which say exactly what each
changes; the admin writes no row state itself.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.text import capfirst
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from . import ordering, requeue, stats
from .backends.base import Reason
from .conf import outbox_settings
from .counting import EstimatingPaginator
from .dashboard import (
    DATABASE_PARAM,
    NewestValuesFilter,
    database_figures,
    health_warnings,
    requested_database,
    retention_notes,
    trend_chart,
)
from .db import DbNow
from .models import OutboxEvent, Status, outbox_db
from .querysets import OutboxEventQuerySet
from .schedule import scheduled_q
from .stats import format_age

#: last_error is cut to this many characters in the changelist; the detail page shows it all.
ERROR_PREVIEW_CHARS = 80

#: The selected events a relay holds that requeue and mark dead name when they leave them alone.
HELD_NAMED = 10

#: Characters of an event id the list shows (the rest is in its tooltip and on its page).
EVENT_ID_CHARS = 8

#: Rows a confirmation page lists, oldest first.
SAMPLE = 10

#: The admin's triage of selected events or of one: the statuses each action changes.
TRIAGE = {"requeue": (Status.PENDING, Status.DEAD), "mark_dead": (Status.PENDING,)}
TRIAGE_TITLES = {"requeue": _("Requeue events"), "mark_dead": _("Mark events dead")}
TRIAGE_SKIPPED = {"requeue": _("already sent"), "mark_dead": _("not pending")}

_STATUS_COLOURS = {Status.PENDING: "#b36b00", Status.SENT: "#2e7d32", Status.DEAD: "#c62828"}


class AgeFilter(admin.SimpleListFilter):
    """By age of the row (database clock): old PENDING rows are the ones that matter."""

    title = _("age")
    parameter_name = "age"
    AGES = {
        "1m": timedelta(minutes=1),
        "10m": timedelta(minutes=10),
        "1h": timedelta(hours=1),
        "1d": timedelta(days=1),
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            ("recent", _("created in the last hour")),
            ("1m", _("older than 1 minute")),
            ("10m", _("older than 10 minutes")),
            ("1h", _("older than 1 hour")),
            ("1d", _("older than 1 day")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if value == "recent":
            return queryset.filter(created_at__gte=DbNow() - timedelta(hours=1))
        if value in self.AGES:
            return queryset.filter(created_at__lte=DbNow() - self.AGES[value])
        return queryset


class ScheduleFilter(admin.SimpleListFilter):
    """Scheduled events (``emit(deliver_at=, delay=)``) not due yet, apart from the rest:
    a backlog of them is waiting by design, not stuck (database clock)."""

    title = _("schedule")
    parameter_name = "scheduled"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            ("yes", _("scheduled, not due yet")),
            ("no", _("not scheduled for later")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        if self.value() == "yes":
            return queryset.filter(scheduled_q())
        if self.value() == "no":
            return queryset.exclude(scheduled_q())
        return queryset


# --- several databases: which outbox the event list shows -----------------------------------


class DatabaseFilter(admin.SimpleListFilter):
    """Which outbox database the list shows, when there are several. The admin's queryset
    is already on it (``get_queryset``), so the actions work on that database's rows."""

    title = _("database")
    parameter_name = DATABASE_PARAM

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        aliases = stats.outbox_databases()
        return [(alias, alias) for alias in aliases] if len(aliases) > 1 else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset

    def choices(self, changelist: Any) -> Iterator[Any]:
        # No "All": a list shows one database's rows; none asked for is the router's.
        current = self.value() or outbox_db()
        for alias, title in self.lookup_choices:
            yield {
                "selected": alias == current,
                "query_string": changelist.get_query_string({self.parameter_name: alias}),
                "display": title,
            }


def link_dashboard(site: admin.AdminSite) -> None:
    """List the dashboard under the app, first, wherever ``site`` lists the apps and their
    models: the admin index, the app index and the navigation sidebar.

    ``AdminSite.get_app_list()`` is the documented way to change that list (a site
    subclass overrides it); the app must not make the project subclass its site, so the
    site's own method is wrapped, once. The entry has the keys Django documents for a model
    of the list, and shows to whoever sees the events (the list holds only models the user
    may view).
    """
    if getattr(site, "_outbox_dashboard_linked", False):
        return
    listed = site.get_app_list

    def get_app_list(request: HttpRequest, app_label: str | None = None) -> list[Any]:
        app_list = listed(request, app_label)
        for app in app_list:
            models = app.get("models", [])
            if app.get("app_label") != OutboxEvent._meta.app_label or not any(
                m.get("model") is OutboxEvent for m in models
            ):
                continue
            url = reverse(f"{site.name}:django_outbox_outboxevent_dashboard", current_app=site.name)
            models.insert(
                0,
                {
                    "model": OutboxEvent,
                    "name": _("Outbox dashboard"),
                    "object_name": "OutboxDashboard",
                    "perms": {"add": False, "change": False, "delete": False, "view": True},
                    "admin_url": url,
                    "add_url": None,
                    "view_only": True,
                },
            )
        return app_list

    site.get_app_list = get_app_list  # type: ignore[method-assign]
    site._outbox_dashboard_linked = True  # type: ignore[attr-defined]


@admin.register(OutboxEvent)
class OutboxEventAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    change_list_template = "admin/django_outbox/outboxevent/change_list.html"
    dashboard_template = "admin/django_outbox/outboxevent/dashboard.html"

    change_form_template = "admin/django_outbox/outboxevent/change_form.html"
    action_template = "admin/django_outbox/outboxevent/action_confirmation.html"

    # Readable at 1,280 px: the event id shortened (whole in its tooltip and on its page,
    # with the row id), times compact, the type, aggregate and error cut with an ellipsis
    # by the stylesheet, and what does not apply to a row (a SENT row's old error and retry
    # time) left empty.
    list_display = (
        "short_event_id",
        "short_type",
        "aggregate",
        "status_badge",
        "retries",
        "next_retry",
        "created",
        "short_error",
    )
    list_display_links = ("short_event_id",)
    list_filter = (
        "status",
        ScheduleFilter,
        ("event_type", NewestValuesFilter),
        ("aggregate_type", NewestValuesFilter),
        AgeFilter,
        DatabaseFilter,
    )
    # Exact matches: an incident hands you an id to paste, and equality uses the indexes.
    search_fields = ("=event_id", "=aggregate_id")
    search_help_text = _("Exact event id or aggregate id.")
    list_per_page = 50
    # The changelist's COUNT(*) over a big outbox is slow and adds nothing to triage: no
    # total, and the result count is exact up to counting.EXACT_UP_TO rows, an estimate
    # above it (the page says "about"; templates/.../pagination.html).
    show_full_result_count = False
    paginator = EstimatingPaginator
    actions = ("requeue", "mark_dead")
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "event_id",
                    "event_type",
                    ("aggregate_type", "aggregate_id"),
                    "status_badge",
                    "retry_count",
                    "replay_count",
                    ("next_retry", "due_at"),
                    "last_error_block",
                )
            },
        ),
        (_("Message"), {"fields": ("payload_pretty", "headers_pretty", "occurred_at")}),
        (
            _("Bookkeeping"),
            {"fields": ("id", "lease_token", "created_at", "updated_at", "sent_at")},
        ),
    )

    def __init__(self, model: type[OutboxEvent], admin_site: admin.AdminSite) -> None:
        super().__init__(model, admin_site)
        link_dashboard(admin_site)

    # --- read-only rows ----------------------------------------------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        queryset = super().get_queryset(request)
        alias = requested_database(request)  # several databases: ?database=ALIAS
        return queryset.using(alias) if alias else queryset

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        names = [f.name for f in self.model._meta.fields]
        return [
            *names,
            "status_badge",
            "next_retry",
            "last_error_block",
            "payload_pretty",
            "headers_pretty",
        ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # events come from outbox.emit() inside a business transaction

    def has_delete_permission(self, request: HttpRequest, obj: OutboxEvent | None = None) -> bool:
        # An undelivered event deleted here is lost for good: PENDING and DEAD rows are
        # requeued or marked dead, never deleted. Only a SENT row may go (purge_outbox
        # removes them in bulk), for a user with the delete permission.
        if obj is not None and obj.status != Status.SENT:
            return False
        return super().has_delete_permission(request, obj)

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # Django 6.1 says where the actions are shown (admin.ActionLocation) and deprecates
        # overrides without the parameter; 5.2 and 6.0 call get_actions(request) only.
        where = {} if action_location is None else {"action_location": action_location}
        actions = super().get_actions(request, **where)
        # Bulk delete of undelivered events loses them; purge_outbox removes SENT rows.
        actions.pop("delete_selected", None)
        return actions

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra_context = {
            **(extra_context or {}),
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
        }
        obj = self.get_object(request, unquote(object_id)) if object_id else None
        if obj is not None and self.has_change_permission(request, obj):
            # The page's requeue and mark-dead buttons, to the same confirmation as the
            # list's actions; the query (?database=, the list's filters) goes along.
            query = f"?{request.GET.urlencode()}" if request.GET else ""
            for action in TRIAGE:
                if obj.status in TRIAGE[action]:
                    url = reverse(self._url_name(action), args=[quote(obj.pk)])
                    extra_context[f"outbox_{action}_url"] = url + query
        return super().changeform_view(request, object_id, form_url, extra_context)

    # --- columns -----------------------------------------------------------------------

    @admin.display(description=_("aggregate"), ordering="aggregate_id")
    def aggregate(self, obj: OutboxEvent) -> str:
        if not obj.aggregate_type and not obj.aggregate_id:
            return "-"
        return _cut(f"{obj.aggregate_type}:{obj.aggregate_id}")

    @admin.display(description=_("event type"), ordering="event_type")
    def short_type(self, obj: OutboxEvent) -> str:
        return _cut(obj.event_type)

    @admin.display(description=_("retries"), ordering="retry_count")
    def retries(self, obj: OutboxEvent) -> int:
        return obj.retry_count

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, obj: OutboxEvent) -> str:
        colour = _STATUS_COLOURS.get(Status(obj.status), "inherit")
        return format_html(
            '<strong class="outbox-status outbox-status-{}" style="color: {}">{}</strong>',
            Status(obj.status).name.lower(),
            colour,
            obj.status_label,
        )

    # Sorted by id: the order the events were written in (an event id sorts randomly).
    @admin.display(description=_("event id"), ordering="id")
    def short_event_id(self, obj: OutboxEvent) -> str:
        event_id = obj.event_id
        if len(event_id) <= EVENT_ID_CHARS:
            return format_html('<span class="outbox-event-id">{}</span>', event_id)
        return format_html(
            '<span class="outbox-event-id" title="{}">{}…</span>',
            event_id,
            event_id[:EVENT_ID_CHARS],
        )

    @admin.display(description=_("next retry"), ordering="next_retry_time")
    def next_retry(self, obj: OutboxEvent) -> str:
        # Only a PENDING row is retried; a SENT or DEAD one keeps its last value, stale.
        return _compact(obj.next_retry_time) if obj.status == Status.PENDING else ""

    @admin.display(description=_("created at"), ordering="created_at")
    def created(self, obj: OutboxEvent) -> str:
        return _compact(obj.created_at)

    @admin.display(description=_("last error"))
    def short_error(self, obj: OutboxEvent) -> str:
        if obj.status == Status.SENT:
            return ""  # an earlier attempt's: the event was sent since
        error = " ".join(obj.last_error.split())
        if len(error) > ERROR_PREVIEW_CHARS:
            error = error[: ERROR_PREVIEW_CHARS - 1] + "…"
        return _cut(error) if error else "-"

    @admin.display(description=_("last error"))
    def last_error_block(self, obj: OutboxEvent) -> str:
        if obj.status == Status.SENT and obj.last_error:
            return format_html(
                '<p>{}</p><pre class="outbox-pre">{}</pre>',
                _("An earlier attempt's error; the event was sent since."),
                obj.last_error,
            )
        return format_html('<pre class="outbox-pre">{}</pre>', obj.last_error or "-")

    @admin.display(description=_("payload"))
    def payload_pretty(self, obj: OutboxEvent) -> str:
        return _pretty(obj.payload)

    @admin.display(description=_("headers"))
    def headers_pretty(self, obj: OutboxEvent) -> str:
        return _pretty(obj.headers)

    # --- actions -----------------------------------------------------------------------

    @admin.action(
        description=_("Requeue selected dead or pending events (due now, retry count reset)"),
        permissions=["change"],
    )
    def requeue(self, request: HttpRequest, queryset: OutboxEventQuerySet) -> HttpResponse | None:
        return self._triage_selected(request, queryset, "requeue")

    @admin.action(description=_("Mark selected pending events as dead"), permissions=["change"])
    def mark_dead(self, request: HttpRequest, queryset: OutboxEventQuerySet) -> HttpResponse | None:
        return self._triage_selected(request, queryset, "mark_dead")

    def _triage_selected(
        self, request: HttpRequest, queryset: OutboxEventQuerySet, action: str
    ) -> HttpResponse | None:
        """A list action: first a confirmation page whose form posts the same selection
        back (as Django's delete confirmation does), then the change."""
        if request.POST.get("post") == "yes":
            self._triage(request, queryset, action)
            return None
        params = [
            ("action", action),
            ("select_across", request.POST.get("select_across", "0")),
            ("post", "yes"),
            *((ACTION_CHECKBOX_NAME, pk) for pk in request.POST.getlist(ACTION_CHECKBOX_NAME)),
        ]
        return self._confirm(request, queryset, action, params, request.get_full_path())

    def triage_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        """The change page's requeue and mark-dead buttons: a confirmation (GET), then the
        change (POST, CSRF-protected), both with the change permission."""
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404(f"No outbox event {object_id!r}.")
        if not self.has_change_permission(request, obj):
            raise PermissionDenied
        query = f"?{request.GET.urlencode()}" if request.GET else ""
        change = reverse(self._url_name("change"), args=[quote(obj.pk)]) + query
        selection: OutboxEventQuerySet = self.get_queryset(request).filter(pk=obj.pk)  # type: ignore[assignment]
        if request.method == "POST":
            self._triage(request, selection, action)
            return HttpResponseRedirect(change)
        return self._confirm(request, selection, action, [], change, (change, str(obj)))

    def _confirm(
        self,
        request: HttpRequest,
        queryset: OutboxEventQuerySet,
        action: str,
        params: list[tuple[str, Any]],
        cancel_url: str,
        *crumbs: tuple[str, str],
    ) -> HttpResponse:
        held = self._held(queryset)
        changed = queryset.exclude_in_flight().filter(status__in=TRIAGE[action])
        count = changed.count()
        context = {
            **self.admin_site.each_context(request),
            "title": TRIAGE_TITLES[action],
            "opts": self.model._meta,
            "app_label": self.model._meta.app_label,
            "breadcrumb_trail": self._trail(*crumbs),
            "action": action,
            "count": count,
            "sample": changed.order_by("id")[:SAMPLE],
            "held": held,
            "held_ids": _ids(held),
            "skipped": queryset.count() - count - len(held),
            "skipped_why": TRIAGE_SKIPPED[action],
            "params": params,
            "cancel_url": cancel_url,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.action_template, context)

    def _triage(self, request: HttpRequest, queryset: OutboxEventQuerySet, action: str) -> None:
        """Requeue or mark dead what ``queryset`` holds, through the QuerySet's lifecycle
        methods. Rows a relay is publishing right now are left alone, as outbox_requeue
        leaves them (requeued, they would be published a second time) and named, so the
        operator can come back to them if they fail."""
        selected = queryset.count()
        held = self._held(queryset)
        rows = queryset.exclude_in_flight()
        if action == "requeue":
            n = rows.requeue()
            done = ngettext(
                "%(count)d event requeued: it is due now and the relay will publish it.",
                "%(count)d events requeued: they are due now and the relay will publish them.",
                n,
            )
        else:
            n = rows.mark_dead()
            done = ngettext(
                "%(count)d event marked dead; the relay will not publish it.",
                "%(count)d events marked dead; the relay will not publish them.",
                n,
            )
        self.message_user(request, done % {"count": n}, messages.SUCCESS)
        if held:
            self._skipped(
                request,
                len(held),
                _(
                    "a relay is publishing it right now, so it would be published anyway; "
                    "if it fails, triage it once the relay has settled it: %(ids)s"
                )
                % {"ids": _ids(held)},
            )
        self._skipped(request, selected - n - len(held), TRIAGE_SKIPPED[action])

    @staticmethod
    def _held(queryset: OutboxEventQuerySet) -> list[str]:
        """The event ids of the rows a relay is publishing right now."""
        return list(queryset.leased().order_by("id").values_list("event_id", flat=True))

    def _url_name(self, view: str) -> str:
        opts = self.model._meta
        return f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_{view}"

    def _trail(self, *more: tuple[str, str]) -> list[tuple[str, str]]:
        """The breadcrumbs between Home and a page's title: the app, the event list, then
        ``more`` (``(url, label)``)."""
        opts = self.model._meta
        app = reverse(f"{self.admin_site.name}:app_list", kwargs={"app_label": opts.app_label})
        return [
            (app, str(opts.app_config.verbose_name)),
            (reverse(self._url_name("changelist")), capfirst(opts.verbose_name_plural)),
            *more,
        ]

    def _skipped(self, request: HttpRequest, n: int, why: Any) -> None:
        if n:
            self.message_user(
                request,
                ngettext(
                    "%(count)d selected event was left alone (%(why)s).",
                    "%(count)d selected events were left alone (%(why)s).",
                    n,
                )
                % {"count": n, "why": why},
                messages.WARNING,
            )

    # --- the changelist banner and the dashboard ---------------------------------------

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra_context = {
            **(extra_context or {}),
            "outbox_warnings": health_warnings(stats.gauges(requested_database(request))),
            "outbox_notes": retention_notes(),
            "dashboard_url": reverse(f"{self.admin_site.name}:django_outbox_outboxevent_dashboard"),
        }
        return super().changelist_view(request, extra_context)

    def get_urls(self) -> list[URLPattern]:
        dashboard = path(
            "dashboard/",
            self.admin_site.admin_view(self.dashboard_view),
            name="django_outbox_outboxevent_dashboard",
        )
        requeue_all = path(
            "dashboard/requeue/",
            self.admin_site.admin_view(self.requeue_view),
            name="django_outbox_outboxevent_requeue",
        )
        # Before the model's own URLs, whose <path:object_id>/ would take them.
        triage = [
            path(
                f"<path:object_id>/{action.replace('_', '-')}/",
                self.admin_site.admin_view(self.triage_view),
                {"action": action},
                name=f"django_outbox_outboxevent_{action}",
            )
            for action in TRIAGE
        ]
        return [dashboard, requeue_all, *triage, *super().get_urls()]

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        databases = database_figures(request)
        snapshot = stats.collect(using=databases.current)
        retries, table = snapshot.triage_matrix()
        changelist = reverse(f"{self.admin_site.name}:django_outbox_outboxevent_changelist")
        context = {
            **self.admin_site.each_context(request),
            "title": _("Outbox dashboard"),
            "breadcrumb_trail": self._trail(),
            "opts": self.model._meta,
            "app_label": self.model._meta.app_label,
            "stats": snapshot,
            # "about N" where a count is the database's estimate (counting.EXACT_UP_TO).
            "shown": {n: snapshot.gauges.shown(n) for n in ("pending", "scheduled", "dead")},
            "oldest_pending_age": format_age(snapshot.oldest_pending_age),
            "alert_pending_age": format_age(outbox_settings.ALERT_PENDING_AGE),
            "outbox_warnings": health_warnings(snapshot.gauges),
            "outbox_notes": retention_notes(),
            "oldest_alert": bool(snapshot.pending)
            and snapshot.oldest_pending_age > outbox_settings.ALERT_PENDING_AGE,
            "triage_retries": retries,
            "triage_table": table,
            "window": format_age(snapshot.window),
            "trend": trend_chart(snapshot),
            "changelist_url": changelist,
            # The figure leaves scheduled events out, so does the list it links to.
            "pending_url": (
                f"{changelist}?status__exact={int(Status.PENDING)}"
                f"&{ScheduleFilter.parameter_name}=no"
            ),
            "dead_url": f"{changelist}?status__exact={int(Status.DEAD)}",
            "scheduled_url": f"{changelist}?{ScheduleFilter.parameter_name}=yes",
            "extra_figures": sorted(snapshot.extra.items()),
            "ordered": ordering.is_enabled(),
            "blocked": [
                (
                    b,
                    reverse(
                        f"{self.admin_site.name}:django_outbox_outboxevent_change", args=[b.id]
                    ),
                )
                for b in snapshot.blocked
            ],
        }
        context.update(self._requeue_all_context(request, snapshot))
        context.update(
            databases.context(
                reverse(f"{self.admin_site.name}:django_outbox_outboxevent_dashboard"), context
            )
        )
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.dashboard_template, context)

    # --- "requeue all N" from the dashboard (the same as manage.py outbox_requeue) -----

    requeue_template = "admin/django_outbox/outboxevent/requeue_confirmation.html"

    def _requeue_all_context(
        self, request: HttpRequest, snapshot: stats.OutboxStats
    ) -> dict[str, Any]:
        """The dashboard's dead letters by reason, and whether to offer "requeue all"."""
        reasons = [r.value for r in Reason]
        return {
            "dead_reasons": (
                stats.dead_reasons(reasons, requested_database(request)) if snapshot.dead else []
            ),
            "can_requeue": self.has_change_permission(request),
            "requeue_url": reverse(f"{self.admin_site.name}:django_outbox_outboxevent_requeue"),
        }

    def requeue_view(self, request: HttpRequest) -> HttpResponse:
        """Requeue every dead letter of one event type or one failure reason.

        GET shows how many and the first of them; the POST of that page (CSRF-protected by
        ``admin_view``) requeues them through :func:`django_outbox.requeue.requeue`, as
        ``manage.py outbox_requeue`` does. Both need the change permission: a crafted POST
        without it is refused before anything is read.
        """
        if not self.has_change_permission(request):
            raise PermissionDenied
        dashboard = reverse(f"{self.admin_site.name}:django_outbox_outboxevent_dashboard")
        params = request.POST if request.method == "POST" else request.GET
        # Several databases: ?database= stays in the URL the confirmation form posts to.
        using = requested_database(request)
        if using:
            dashboard += f"?{DATABASE_PARAM}={using}"
        try:
            selection, command = requeue_all_selection(params)
            command += f" --database {shlex.quote(using)}" if using else ""
        except ValueError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return HttpResponseRedirect(dashboard)
        if request.method == "POST":
            result = requeue.requeue(selection, using=using)
            self.message_user(
                request,
                ngettext(
                    "%(count)d dead event requeued (%(filters)s): it is due now and the "
                    "relay will publish it.",
                    "%(count)d dead events requeued (%(filters)s): they are due now and the "
                    "relay will publish them.",
                    result.changed,
                )
                % {"count": result.changed, "filters": selection.describe()},
                messages.SUCCESS if result.changed else messages.WARNING,
            )
            return HttpResponseRedirect(dashboard)
        preview = requeue.requeue(selection, dry_run=True, using=using)
        context = {
            **self.admin_site.each_context(request),
            "title": _("Requeue dead letters"),
            "breadcrumb_trail": self._trail((dashboard, str(_("Outbox dashboard")))),
            "opts": self.model._meta,
            "app_label": self.model._meta.app_label,
            "count": preview.changed,
            "filters": selection.describe(),
            "sample": preview.sample,
            "params": [(k, params[k]) for k in ("event_type", "reason") if params.get(k)],
            "command": command,
            "cancel_url": dashboard,
            "changelist_url": reverse(
                f"{self.admin_site.name}:django_outbox_outboxevent_changelist"
            ),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.requeue_template, context)


def requeue_all_selection(params: Any) -> tuple[requeue.Selection, str]:
    """The dead letters a "requeue all" link names (``event_type`` or a failure ``reason``,
    exactly one), and the ``outbox_requeue`` command line that selects the same."""
    event_type = params.get("event_type", "")
    reason = params.get("reason", "")
    if bool(event_type) == bool(reason):
        raise ValueError(_("Name either an event type or a failure reason to requeue."))
    if event_type:
        selection = requeue.Selection(event_types=(event_type,))
        option = f"--event-type {shlex.quote(event_type)}"
    else:
        if reason not in {r.value for r in Reason}:
            raise ValueError(_("Unknown failure reason %(reason)r.") % {"reason": reason})
        selection = requeue.Selection(error_contains=f"[{reason}]")
        option = f"--error-contains {shlex.quote(f'[{reason}]')}"
    return selection, f"python manage.py outbox_requeue {option}"


def _ids(event_ids: list[str]) -> str:
    """The first event ids of a list, for a message that names them."""
    return ", ".join(event_ids[:HELD_NAMED]) + (", ..." if len(event_ids) > HELD_NAMED else "")


def _compact(moment: datetime | None) -> str:
    """``12-04 23:22:08`` in the current time zone, the whole time in its tooltip: a
    narrow column."""
    if moment is None:
        return ""
    if timezone.is_aware(moment):
        moment = timezone.localtime(moment)
    return format_html(
        '<span title="{}">{}</span>',
        moment.isoformat(sep=" ", timespec="seconds"),
        moment.strftime("%m-%d %H:%M:%S"),
    )


def _cut(text: str) -> str:
    """``text`` in a cell the stylesheet may cut with an ellipsis, whole in its tooltip."""
    return format_html('<span title="{}">{}</span>', text, text)


def _pretty(value: Any) -> str:
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    return format_html('<pre class="outbox-pre">{}</pre>', text)


# Django task results (docs/tasks.md): their own module, so that this one stays readable.
from . import tasks_admin  # noqa: E402, F401
