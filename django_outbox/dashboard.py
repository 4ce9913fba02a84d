"""What the outbox admin shows besides its rows: the health banner, the dashboard's
created-vs-sent chart, and which outbox database a page shows when there are several
(``?database=ALIAS``) with each one's figures."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db import connections
from django.http import Http404, HttpRequest, QueryDict
from django.utils.formats import number_format
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from . import counting, stats
from .conf import outbox_settings
from .models import outbox_db
from .stats import format_age


def health_warnings(gauges: stats.Gauges) -> list[str]:
    """The banner lines: an old PENDING event (relay stuck?) or any dead letter."""
    warnings = []
    threshold = outbox_settings.ALERT_PENDING_AGE
    if gauges.pending and gauges.oldest_pending_age > threshold:
        warnings.append(
            _(
                "The oldest PENDING event has waited %(age)s, longer than %(limit)s "
                "(OUTBOX_ALERT_PENDING_AGE): is publish_outbox running and is the broker up?"
            )
            % {"age": format_age(gauges.oldest_pending_age), "limit": format_age(threshold)}
        )
    if gauges.dead:
        warnings.append(
            ngettext(
                "%(count)s dead letter is waiting for triage.",
                "%(count)s dead letters are waiting for triage.",
                gauges.dead,
            )
            % {"count": gauges.shown("dead")}
        )
    if gauges.blocked_aggregates:
        warnings.append(
            ngettext(
                "%(count)d aggregate is blocked by a dead event (ordered mode): its later "
                "events wait until that event is requeued.",
                "%(count)d aggregates are blocked by a dead event (ordered mode): their later "
                "events wait until that event is requeued.",
                gauges.blocked_aggregates,
            )
            % {"count": gauges.blocked_aggregates}
        )
    return warnings


def retention_notes() -> list[str]:
    """The banner's notes that are no alarm: SENT rows are not kept
    (``OUTBOX_RETENTION_DAYS = 0``), so the SENT figures here read zero."""
    if not outbox_settings.deletes_on_confirm:
        return []
    return [
        str(
            _(
                "OUTBOX_RETENTION_DAYS is 0: the relay deletes each event once the broker "
                "confirmed it, so no SENT rows are kept and the SENT figures here count only "
                "rows from before the setting. Count sent events with the metric "
                "django_outbox_events_published_total; replay from the broker."
            )
        )
    ]


#: The query parameter that picks the outbox database (the dashboard, the changelist and a
#: change page); without it, the router's choice, as with one database.
DATABASE_PARAM = "database"


def requested_database(request: HttpRequest) -> str | None:
    """The alias asked for by ``?database=``, or carried back from the changelist by a change
    page's ``_changelist_filters``; 404 when no outbox lives there. Checked once a request."""
    if hasattr(request, "_outbox_database"):
        return request._outbox_database  # type: ignore[no-any-return]
    alias = request.GET.get(DATABASE_PARAM)
    if alias is None and "_changelist_filters" in request.GET:
        alias = QueryDict(request.GET["_changelist_filters"]).get(DATABASE_PARAM)
    if alias and alias not in stats.outbox_databases():
        raise Http404(f"No outbox database {alias!r}.")
    request._outbox_database = alias or None  # type: ignore[attr-defined]
    return request._outbox_database  # type: ignore[attr-defined, no-any-return]


class NewestValuesFilter(admin.AllValuesFieldListFilter):
    """A filter by a column's values (the event type, the aggregate type) that lists the
    values of the newest :data:`~django_outbox.counting.EXACT_UP_TO` rows, not of every row.

    Django's own reads ``SELECT DISTINCT`` over the whole table: 250 ms a filter with a
    million rows on PostgreSQL (``bench.reads_bench``), for a column no index leads. Past
    the bound the filter's title says so; a value typed into the URL
    (``?event_type=X``) filters every row, and shows as chosen."""

    def __init__(
        self,
        field: Any,
        request: HttpRequest,
        params: Any,
        model: Any,
        model_admin: Any,
        field_path: str,
    ) -> None:
        super().__init__(field, request, params, model, model_admin, field_path)
        queryset = model_admin.get_queryset(request)  # on the database the list shows
        newest = queryset.order_by("-pk").values_list(field.name)[: counting.EXACT_UP_TO]
        # Compiled for the queryset's own database (sql_with_params() compiles for the
        # default one, whose quoting another engine refuses).
        sql, sql_params = newest.query.get_compiler(using=newest.db).as_sql()
        connection = connections[newest.db]
        column = connection.ops.quote_name(field.column)
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT DISTINCT newest.{column} FROM ({sql}) newest ORDER BY 1", sql_params
            )
            values = [row[0] for row in cursor.fetchall()]
        if self.lookup_val is not None:
            values = sorted({*values, *self.lookup_val})
        self.lookup_choices = values  # type: ignore[assignment]
        if queryset.order_by("-pk")[counting.EXACT_UP_TO :][:1].exists():
            self.title = _("%(title)s (of the newest %(count)s events)") % {
                "title": self.title,
                "count": number_format(counting.EXACT_UP_TO, force_grouping=True),
            }


# --- several databases: which outbox the dashboard shows ------------------------------------


class DatabaseFigures:
    """The outbox databases of the dashboard: the one shown (``?database=ALIAS``, default
    the router's write alias) and, when there are several, each one's gauges."""

    def __init__(self, current: str, aliases: list[str]) -> None:
        self.current, self.aliases = current, aliases

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for alias in self.aliases:
            try:
                gauges: stats.Gauges | None = stats.gauges(alias)
            except Exception:  # one database down must not hide the others
                gauges = None
            rows.append(
                {
                    "alias": alias,
                    "gauges": gauges,
                    "oldest": format_age(gauges.oldest_pending_age) if gauges else "",
                    "warnings": bool(gauges and health_warnings(gauges)),
                }
            )
        return rows

    def context(self, dashboard_url: str, context: dict[str, Any]) -> dict[str, Any]:
        """The databases table, and the dashboard's links to the event list and to events
        pointed at the database shown (``?database=``, which the changelist reads)."""
        rows = self.rows() if len(self.aliases) > 1 else []
        for row in rows:
            row["url"] = f"{dashboard_url}?{DATABASE_PARAM}={row['alias']}"
        extra: dict[str, Any] = {"outbox_database": self.current, "outbox_databases": rows}
        extra["database_query"] = ""
        if self.current == outbox_db():
            return extra
        # The "requeue all" links add their own query to it.
        extra["database_query"] = f"{DATABASE_PARAM}={self.current}&"
        changelist = context.get("changelist_url", "")
        for key, value in context.items():
            if isinstance(value, str) and value.split("?")[0] == changelist:
                extra[key] = self.link(value)
        if context.get("blocked"):
            extra["blocked"] = [(b, self.link(url)) for b, url in context["blocked"]]
        return extra

    def link(self, url: str) -> str:
        """``url`` (a changelist or change page) on the database shown."""
        return f"{url}{'&' if '?' in url else '?'}{DATABASE_PARAM}={self.current}"


def database_figures(request: HttpRequest) -> DatabaseFigures:
    """The dashboard's databases; an alias that holds no outbox is a 404, not an error page."""
    requested = requested_database(request)
    aliases = stats.outbox_databases()
    default = outbox_db() if outbox_db() in aliases else aliases[0]
    return DatabaseFigures(requested or default, aliases)


def trend_chart(
    snapshot: stats.OutboxStats, *, width: int = 760, height: int = 190
) -> dict[str, Any]:
    """Coordinates of the created-vs-sent chart; the template draws them as inline SVG.

    Created rows are bars, sent rows a line through the bars' centres: where the line
    runs below the bars, the backlog grows.
    """
    left, right_pad, bottom, top = 40, 24, 22, 12
    plot_w, plot_h = width - left - right_pad, height - bottom - top
    buckets = snapshot.trend
    peak = max([1, *(b.created for b in buckets), *(b.sent for b in buckets)])
    slot = plot_w / max(len(buckets), 1)
    baseline = top + plot_h

    def y(v: int) -> float:
        return baseline - v / peak * plot_h

    bars = [
        {
            "x": f"{left + i * slot + slot * 0.1:.1f}",
            "y": f"{y(b.created):.1f}",
            "w": f"{slot * 0.8:.1f}",
            "h": f"{baseline - y(b.created):.1f}",
            "title": f"{b.start:%H:%M} created {b.created}, sent {b.sent}",
        }
        for i, b in enumerate(buckets)
        if b.created
    ]
    sent_points = " ".join(
        f"{left + (i + 0.5) * slot:.1f},{y(b.sent):.1f}" for i, b in enumerate(buckets)
    )
    labels = [
        {"x": f"{left + (i + 0.5) * slot:.1f}", "text": buckets[i].start.strftime("%H:%M")}
        for i in sorted({0, len(buckets) // 4, len(buckets) // 2, 3 * len(buckets) // 4})
        if i < len(buckets)
    ]
    labels.append({"x": f"{left + plot_w:.1f}", "text": str(_("now"))})
    return {
        "width": width,
        "height": height,
        "left": left,
        "right": left + plot_w,
        "top": top,
        "baseline": baseline,
        "peak": peak,
        "bars": bars,
        "sent_points": sent_points,
        "labels": labels,
        "label_y": height - 6,
        "created_total": sum(b.created for b in buckets),
        "sent_total": sum(b.sent for b in buckets),
        "bucket": format_age(snapshot.trend_bucket_seconds),
    }
