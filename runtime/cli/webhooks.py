"""``orgchart webhooks``: the endpoints and their deliveries.

``add NAME --url URL --events E[,E...] --secret-env VAR [--tenant T]`` stores an endpoint
(the events are names or globs of ``tree.finished``, ``task.question``,
``task.awaiting_approval``, ``task.escalated``, ``task.cancelled``, ``fire.rollup``;
``VAR`` is the environment variable that holds the ``whsec_...`` secret, read by the
processes that deliver). ``list`` shows the endpoints and their counts; ``test NAME``
sends a ``webhook.test`` event now and says what the receiver answered;
``deliveries [--failed]`` lists the latest events; ``redeliver ID`` sends one again
with the same ``webhook-id``. An unknown event name, a URL the SSRF rule refuses or an
unknown endpoint exits 2 and changes nothing.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from runtime.cli.common import JsonOpt, opened_store, out, print_json, settings
from runtime.store.rows import NotFound
from runtime.webhooks import DeliveryConfig, add_endpoint, as_json, send_test


def add(name: Annotated[str, typer.Argument(help="The endpoint's name.")],
        url: Annotated[str, typer.Option("--url", help="Where to POST (http or https).")],
        events: Annotated[str, typer.Option(
            "--events", help="Event names or globs, comma-separated (task.*).")],
        secret_env: Annotated[str, typer.Option(
            "--secret-env", help="The variable holding the whsec_ secret.")],
        tenant: Annotated[str | None, typer.Option(
            "--tenant", help="Only this tenant's trees.")] = None,
        json_: JsonOpt = False) -> None:
    """Subscribe an endpoint to events (replaces one of the same name)."""
    cfg = settings()
    with opened_store(cfg) as store:
        row = add_endpoint(store, cfg, name, url, events.split(","), secret_env, tenant)
    if json_:
        print_json({"name": row.name, "url": row.url, "events": list(row.events),
                    "tenant": row.tenant, "secret_env": row.secret_env})
        return
    out.print(f"webhook {escape(row.name)} -> {escape(row.url)}: {', '.join(row.events)}")
    out.print(f"[dim]the workers and serve deliver with {row.secret_env} set in their "
              "environment; one started before the first endpoint existed delivers after "
              "its restart[/]")


def list_(json_: JsonOpt = False) -> None:
    """The endpoints, with their pending, delivered and dead events."""
    with opened_store() as store:
        rows = [as_json(r) for r in store.webhooks.endpoints()]
    if json_:
        print_json(rows)
        return
    if not rows:
        out.print("no webhook endpoint ([webhooks.<name>] or orgchart webhooks add)")
        return
    table = Table("name", "url", "events", "tenant", "secret", "pending", "delivered", "dead")
    for r in rows:
        table.add_row(escape(r["name"]), escape(r["url"]), ", ".join(r["events"]),
                      r["tenant"] or "-", r["secret_env"], str(r["pending"]),
                      str(r["delivered"]), str(r["dead"]))
    out.print(table)


def test(name: Annotated[str, typer.Argument(help="The endpoint to send a test event to.")],
         json_: JsonOpt = False) -> None:
    """Send a ``webhook.test`` event now and print what the receiver answered."""
    cfg = settings()
    with opened_store(cfg) as store:
        row = send_test(store, DeliveryConfig.from_settings(cfg), name)
    if json_:
        print_json(as_json(row))
        return
    said = f"HTTP {row['last_status']}" if row["last_status"] else row["last_error"] or "-"
    out.print(f"test event {row['id']} to {escape(name)}: {row['status']} ({escape(said)})")


def deliveries(failed: Annotated[bool, typer.Option(
                   "--failed", help="Only the dead and those failing.")] = False,
               endpoint: Annotated[str | None, typer.Option(
                   "--endpoint", help="Only this endpoint's.")] = None,
               limit: Annotated[int, typer.Option("--limit", min=1, max=10_000)] = 50,
               json_: JsonOpt = False) -> None:
    """The latest events sent or to send, newest first."""
    with opened_store() as store:
        rows = [as_json(r) for r in store.webhooks.deliveries(failed, endpoint, limit)]
    if json_:
        print_json(rows)
        return
    table = Table("id", "endpoint", "event", "status", "attempts", "answer", "created")
    for r in rows:
        said = (f"HTTP {r['last_status']}" if r["last_status"] else r["last_error"] or "-")
        table.add_row(str(r["id"]), escape(r["endpoint"]), r["event"], r["status"],
                      str(r["attempts"]), escape(said[:80]), r["created_at"][:19])
    out.print(table)


def redeliver(outbox_id: Annotated[int, typer.Argument(help="The event's id (deliveries).")],
              json_: JsonOpt = False) -> None:
    """Send a delivered or dead event again, with the same ``webhook-id``."""
    with opened_store() as store:
        row = store.webhooks.redeliver(outbox_id)
    if row is None:
        raise NotFound(f"no webhook event {outbox_id}")
    if json_:
        print_json(as_json(row))
        return
    if "notified" in row:
        out.print(f"event {outbox_id} queued again for {escape(row['endpoint'])}")
    else:
        out.print(f"event {outbox_id} is still {row['status']}: it goes out anyway",
                  style="yellow")
