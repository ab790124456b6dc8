"""``cmb-dagster callbacks``: create, inspect and cancel callbacks, report their status, and run a worker outside
Dagster."""

import json
import logging
import signal
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from cmb_dagster.callbacks import admin
from cmb_dagster.callbacks.admin import status as engine_status
from cmb_dagster.callbacks.client import CallbackClient
from cmb_dagster.callbacks.errors import InvalidCallbackInput
from cmb_dagster.callbacks.models import (
    MAX_BUCKETS,
    MAX_PRIORITY,
    MAX_REPLAY_BATCH,
    MAX_TTL_DAYS,
    CallbackEvent,
    CallbackSettings,
    EndpointHealth,
    EndpointPolicy,
)
from cmb_dagster.callbacks.schedules import materialize_schedules
from cmb_dagster.callbacks.worker import CallbackWorker, bucket_slice
from cmb_dagster.cli_common import DAY, DURATION, FloatRange, liveness_options, open_database
from cmb_dagster.flow import MAX_CONCURRENCY, FlowLimits
from cmb_dagster.workers import stop_workers_on_signals

KEYS = [click.argument("owner_client_id"), click.argument("group_key"), click.argument("event_key")]


def _keys(f):  # type: ignore[no-untyped-def]
    for decorator in reversed(KEYS):
        f = decorator(f)
    return f


def _client(allow_hosts: tuple[str, ...] = ()) -> CallbackClient:
    hosts = [h for value in allow_hosts for h in value.split(",")]
    settings = CallbackSettings(allowed_hosts=hosts) if hosts else CallbackSettings()
    return CallbackClient(open_database(), settings, buffered=False)


def _json(value: str | None, name: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidCallbackInput(f"{name}: not valid JSON ({exc.msg})") from None


def _when(at: str | None, delay: float | None) -> datetime:
    if (at is None) == (delay is None):
        raise click.UsageError("give exactly one of --at and --in")
    if delay is not None:
        return datetime.now(UTC) + timedelta(seconds=delay)
    try:
        when = datetime.fromisoformat(at)  # type: ignore[arg-type]
    except ValueError:
        raise InvalidCallbackInput(f"run_at: {at!r} is not an ISO 8601 time") from None
    if when.tzinfo is None:
        raise InvalidCallbackInput(f"run_at: {at!r} has no timezone (add Z or +HH:MM)")
    return when


def _bucket_ids(value: str | None) -> str | None:
    if value and not all(part.strip().isdigit() for part in value.split(",")):
        raise click.BadParameter(
            f"{value!r} is not a comma-separated list of bucket ids such as 0,1,2", param_hint="'--buckets'"
        )
    return value


@click.group()
def callbacks() -> None:
    """Delayed callbacks: call a URL (or launch a Dagster job) at a given time."""


@callbacks.command()
@_keys
@click.option("--at", "at", help="When to call, ISO 8601 with a timezone (e.g. 2030-01-01T09:00:00Z).")
@click.option("--in", "delay", type=FloatRange(0, 100 * 365.25 * DAY), help="When to call, in seconds from now.")
@click.option("--url", "cb_url", required=True, help="http(s):// URL to POST to, or dagster://<job_name>.")
@click.option(
    "--context",
    help='JSON sent along with the call; for dagster://<job>: {"run_config": {...}, "tags": {"key": "value"}}.',
)
@click.option("--retry", help='Retry policy as JSON, e.g. {"backoff": "exponential", "delay": 10}.')
@click.option(
    "--body",
    type=click.Choice(["envelope", "context"]),
    default="envelope",
    show_default=True,
    help="What the request carries: the envelope (keys, times, attempt, context), or the context alone.",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    help="Open a target for this create (as on the worker; the worker must open it too).",
)
@click.option(
    "--priority",
    type=click.IntRange(-MAX_PRIORITY, MAX_PRIORITY),
    default=0,
    show_default=True,
    help=f"Among callbacks due, higher is called first ({-MAX_PRIORITY} to {MAX_PRIORITY}).",
)
@click.option(
    "--on-failure",
    help="http(s) URL or dagster://<job> called once if the event fails for good (default: the owner's hook).",
)
@click.option("--endpoint", help="The endpoint name its calls count for (default: the URL without its query).")
def create(
    owner_client_id: str,
    group_key: str,
    event_key: str,
    at: str | None,
    delay: float | None,
    cb_url: str,
    context: str | None,
    retry: str | None,
    body: str,
    allow_hosts: tuple[str, ...],
    priority: int,
    on_failure: str | None,
    endpoint: str | None,
) -> None:
    """Schedule a callback; print its event id."""
    with _client(allow_hosts) as client:
        event_id = client.create(
            owner_client_id,
            group_key,
            event_key,
            _when(at, delay),
            cb_url,
            _json(context, "context"),
            _json(retry, "retry"),
            body=body,  # type: ignore[arg-type]
            priority=priority,
            on_failure=on_failure,
            endpoint=endpoint,
        )
    click.echo(event_id)


@callbacks.command()
@_keys
def show(owner_client_id: str, group_key: str, event_key: str) -> None:
    """Print an event as JSON."""
    with _client() as client:
        event = client.get(owner_client_id, group_key, event_key)
    click.echo(event.model_dump_json(indent=2))


@callbacks.command(name="list")
@click.option("--owner", "owner_client_id", help="Only this owner's events.")
@click.option("--group", "group_key", help="Only this group's events.")
@click.option("--status", help="pending, notified, failed, cancelled or rejected.")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 100_000))
def list_(owner_client_id: str | None, group_key: str | None, status: str | None, limit: int) -> None:
    """List events by run_at."""
    with _client() as client:
        events = client.list(owner_client_id, group_key, status, limit)
    if not events:
        click.echo("no events")
    for e in events:
        click.echo(
            f"{e.event_id}\t{e.status.value}\t{e.run_at.isoformat()}\t{e.owner_client_id}/{e.group_key}/"
            f"{e.event_key}\t{e.cb_url}\tattempts={e.attempts}"
        )


@callbacks.command()
@_keys
def cancel(owner_client_id: str, group_key: str, event_key: str) -> None:
    """Cancel a pending event."""
    with _client() as client:
        client.cancel(owner_client_id, group_key, event_key)
    click.echo("cancelled")


@callbacks.command()
@_keys
@click.option("--force", is_flag=True, help="Delete even a pending event due within a minute.")
def delete(owner_client_id: str, group_key: str, event_key: str, force: bool) -> None:
    """Delete an event."""
    with _client() as client:
        client.delete(owner_client_id, group_key, event_key, force=force)
    click.echo("deleted")


@callbacks.command()
@click.option(
    "--ttl-days",
    default=30,
    show_default=True,
    type=click.IntRange(0, MAX_TTL_DAYS),
    help="Remove finished events older than this.",
)
def clean(ttl_days: int) -> None:
    """Remove finished events and change_log entries older than --ttl-days."""
    with _client() as client:
        report = client.clean(ttl_days)
    click.echo(f"removed {report.events} events, {report.change_log} change_log entries")


@callbacks.command()
@click.argument("count", type=click.IntRange(1, MAX_BUCKETS))
def buckets(count: int) -> None:
    """Set the number of buckets to COUNT (1 to 4096); pending events of removed buckets move to the rest."""
    with _client() as client:
        ids = client.set_bucket_count(count)
    click.echo(f"{len(ids)} buckets")


@callbacks.command()
@click.option(
    "--buckets",
    "bucket_list",
    callback=lambda ctx, param, value: _bucket_ids(value),
    help="Comma-separated bucket ids (default: all, including added ones).",
)
@click.option(
    "--index",
    type=click.IntRange(0, MAX_BUCKETS - 1),
    help="With --workers: serve the buckets with id % workers == index (also those added later).",
)
@click.option(
    "--workers",
    type=click.IntRange(1, MAX_BUCKETS),
    help="Number of workers splitting the buckets (with --index).",
)
@click.option("--duration", type=DURATION, help="Seconds to work (default: until SIGTERM or Ctrl-C).")
@click.option("--worker-concurrency", type=click.IntRange(1, 10_000), help="Parallel calls of this worker.")
@click.option(
    "--concurrency",
    type=click.IntRange(1, 10_000),
    deprecated="use --worker-concurrency instead",
    hidden=True,
)
@click.option(
    "--per-host-concurrency",
    type=click.IntRange(0, MAX_CONCURRENCY),
    help="Calls in flight to one host across all workers (0: no limit; default 64).",
)
@click.option("--timeout", type=FloatRange(0.1, 3600), help="Seconds one call may take.")
@click.option("--poll-interval", type=FloatRange(0.01, 3600), help="Seconds between polls of a bucket.")
@click.option(
    "--lease-ttl", type=FloatRange(1, 3600), help="Seconds after which a dead worker's buckets are taken over."
)
@click.option(
    "--materialize/--no-materialize",
    default=True,
    show_default=True,
    help="Also turn cron schedules into events, every 30 s.",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    help="Open a target: host name, *.domain, address or CIDR range ('*': any public host). Repeatable; "
    "replaces CMB_CALLBACK_ALLOWED_HOSTS. Loopback, private and link-local addresses are closed "
    "unless opened.",
)
@liveness_options
def worker(
    bucket_list: str | None,
    index: int | None,
    workers: int | None,
    duration: float | None,
    worker_concurrency: int | None,
    concurrency: int | None,
    per_host_concurrency: int | None,
    timeout: float | None,
    poll_interval: float | None,
    lease_ttl: float | None,
    materialize: bool,
    allow_hosts: tuple[str, ...],
) -> None:
    """Call callbacks back, as a long-running process (SIGTERM finishes the calls in flight, then exits)."""
    if (index is None) != (workers is None) or (bucket_list and index is not None):
        raise click.UsageError("give --index and --workers together, or --buckets")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {
        "worker_concurrency": worker_concurrency or concurrency,
        "timeout": timeout,
        "poll_interval": poll_interval,
        "lease_ttl": lease_ttl,
        "allowed_hosts": [h for value in allow_hosts for h in value.split(",")] or None,
        "per_host": None if per_host_concurrency is None else FlowLimits(concurrency=per_host_concurrency or None),
    }
    settings = CallbackSettings(**{k: v for k, v in overrides.items() if v is not None})
    db = open_database()
    chosen = [int(b) for b in bucket_list.split(",")] if bucket_list else None  # checked by _bucket_ids
    runner = CallbackWorker(db, settings, buckets=chosen if index is None else bucket_slice(db, index, workers))
    stopped = threading.Event()
    if materialize:

        def materialize_loop() -> None:
            while not stopped.is_set():
                try:
                    materialize_schedules(db)
                except Exception:
                    logging.getLogger("cmb_dagster.callbacks").exception("materializing schedules failed")
                stopped.wait(30)

        threading.Thread(target=materialize_loop, name="cmb-callback-schedules", daemon=True).start()
    serves = bucket_list or ("all" if index is None else f"with id % {workers} == {index}")
    click.echo(f"callbacks worker {runner.owner} on buckets {serves}", err=True)
    try:
        with stop_workers_on_signals():
            report = runner.run(duration)
    finally:
        stopped.set()
    click.echo(f"delivered {report.items} events in {report.seconds:.1f}s ({report.errors} errors)", err=True)


@callbacks.command()
def status() -> None:
    """Events per status, how late the overdue pending ones are, and the limits per key with the calls in flight."""
    report = engine_status(open_database())
    counts = report.totals
    assert counts is not None
    click.echo(
        f"pending {counts.pending} (overdue {counts.overdue}, oldest {counts.oldest_overdue_seconds:.1f}s late), "
        f"notified {counts.notified}, failed {counts.failed} (dead letters: `callbacks failed`), "
        f"rejected {counts.rejected}, cancelled {counts.cancelled}, held {counts.held} and disabled "
        f"{counts.disabled} by their endpoints"
    )
    if report.endpoints is not None:
        click.echo(f"endpoints: {report.endpoints.open} open, {report.endpoints.disabled} disabled")
        for health in report.unhealthy:
            click.echo("  " + _endpoint_line(health))
    for use in report.limits:
        limits = [f"{use.in_flight}/{use.concurrency} in flight" if use.concurrency else f"{use.in_flight} in flight"]
        if use.rate_per_second is not None:
            limits.append(f"{use.rate_per_second:g}/s (burst {use.burst:g}, {use.tokens or 0:.1f} tokens now)")
        click.echo(f"{use.scope} {use.key or '-'}: {', '.join(limits)}")


def _dead_letter_options(f):  # type: ignore[no-untyped-def]
    options = [
        click.option("--owner", "owner_client_id", help="Only this owner's events."),
        click.option("--group", "group_key", help="Only this group's events (with --owner)."),
        click.option("--key", "event_key", help="Only this event (with --owner and --group)."),
        click.option("--since", help="Failed at or after this time (ISO 8601 with a timezone)."),
        click.option("--until", help="Failed before this time (ISO 8601 with a timezone)."),
        click.option(
            "--limit", default=1000, show_default=True, type=click.IntRange(1, MAX_REPLAY_BATCH), help="At most."
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _selection(**given: Any) -> dict[str, Any]:
    for name in ("since", "until"):
        if given[name] is not None:
            given[name] = _when(given[name], None)
    return given


@callbacks.command()
@_dead_letter_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def failed(as_json: bool, **selection: Any) -> None:
    """List the events that failed for good (dead letters), oldest failure first, with their last error."""
    events = admin.failed(open_database(), **_selection(**selection))
    if not events and not as_json:
        click.echo("no failed events")
    for e in events:
        click.echo(e.model_dump_json() if as_json else _dead_letter_line(e))


def _dead_letter_line(e: CallbackEvent) -> str:
    failed_at = e.finished_at.isoformat() if e.finished_at else "-"
    return (
        f"{e.event_id}\t{failed_at}\t{e.owner_client_id}/{e.group_key}/{e.event_key}\t{e.cb_url}\t"
        f"attempts={e.attempts}\treplays={e.replays}\tstatus={e.last_status_code or '-'}\t{e.last_error or ''}"
    )


@callbacks.command()
@_dead_letter_options
def replay(**selection: Any) -> None:
    """Send failed events again (a new round of retries, the same webhook-id); print how many."""
    count = admin.replay(open_database(), **_selection(**selection))
    more = " (the limit: run it again for more)" if count == selection["limit"] else ""
    click.echo(f"replayed {count} events{more}")


@callbacks.command(name="on-failure")
@click.argument("owner_client_id")
@click.argument("url", required=False)
@click.option("--clear", is_flag=True, help="Remove the owner's failure hook.")
@click.option("--allow-host", "allow_hosts", multiple=True, help="Open a target for the hook (as on the worker).")
def on_failure(owner_client_id: str, url: str | None, clear: bool, allow_hosts: tuple[str, ...]) -> None:
    """Set (URL), clear (--clear) or show the failure hook of the owner's events without their own."""
    if url is not None and clear:
        raise click.UsageError("give a URL or --clear, not both")
    with _client(allow_hosts) as client:
        if url is None and not clear:
            click.echo(admin.failure_hook(client.db, owner_client_id) or "no failure hook")
            return
        client.set_failure_hook(owner_client_id, url)
    click.echo("cleared" if clear else "set")


@callbacks.command(name="endpoints")
@click.option("--owner", "owner_client_id", help="Only this owner's endpoints.")
@click.option("--state", type=click.Choice(["closed", "open", "disabled"]), help="Only endpoints in this state.")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, admin.MAX_ENDPOINTS_LISTED))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def endpoints_(owner_client_id: str | None, state: str | None, limit: int, as_json: bool) -> None:
    """The endpoints' health (circuit breakers), disabled first, then open, then closed."""
    found = admin.endpoints(open_database(), owner_client_id, state=state, limit=limit)
    if not found and not as_json:
        click.echo("no endpoints")
    for health in found:
        click.echo(health.model_dump_json() if as_json else _endpoint_line(health))


def _endpoint_line(h: EndpointHealth) -> str:
    since = {"open": h.opened_at, "disabled": h.disabled_at}.get(h.state)
    state = f"{h.state} since {since.isoformat()}" if since else h.state
    if h.state == "disabled":
        state += f" (by the {h.disabled_by})"
    last_ok = h.last_success_at.isoformat() if h.last_success_at else "never"
    return (
        f"{h.owner_client_id}\t{h.endpoint}\t{state}\tfailures in a row {h.consecutive_failures}\t"
        f"window {h.window_failures}/{h.window_calls} failed\tlast success {last_ok}\theld {h.held}\t"
        f"disabled {h.disabled}\t{h.last_error or ''}"
    )


@callbacks.group()
def endpoint() -> None:
    """Act on an owner's endpoint (its circuit breaker)."""


_ENDPOINT_ARGS = [
    click.option("--owner", "owner_client_id", required=True, help="The owner of the endpoint."),
    click.argument("url"),
]


def _endpoint_args(f):  # type: ignore[no-untyped-def]
    for decorator in reversed(_ENDPOINT_ARGS):
        f = decorator(f)
    return f


@endpoint.command()
@_endpoint_args
def enable(owner_client_id: str, url: str) -> None:
    """Close the endpoint of URL (or of that name) and send its held and disabled events again, oldest first."""
    count = admin.enable_endpoint(open_database(), owner_client_id, url)
    click.echo(f"enabled; {count} events will be sent again")


@endpoint.command()
@_endpoint_args
def disable(owner_client_id: str, url: str) -> None:
    """Keep the events of the endpoint of URL (or of that name) as disabled (not called) until it is enabled."""
    count = admin.disable_endpoint(open_database(), owner_client_id, url)
    click.echo(f"disabled; {count} held events kept as disabled")


@endpoint.command()
@click.option("--owner", "owner_client_id", required=True, help="The owner whose endpoints it applies to.")
@click.option("--failure-threshold", type=click.IntRange(1, 1_000_000), help="Failed calls in a row that open one.")
@click.option("--probe-interval", type=FloatRange(0.001, 30 * DAY), help="Seconds before the first probe.")
@click.option("--disable-after", type=FloatRange(1, 366 * DAY), help="Seconds open before it is disabled.")
@click.option("--never-disable", is_flag=True, help="Never disable the owner's endpoints.")
@click.option("--clear", is_flag=True, help="Back to the workers' default policy.")
def policy(
    owner_client_id: str,
    failure_threshold: int | None,
    probe_interval: float | None,
    disable_after: float | None,
    never_disable: bool,
    clear: bool,
) -> None:
    """Show or set the owner's circuit breaker policy (what is not given keeps its value, from EndpointPolicy's
    defaults for an owner without a policy of its own)."""
    db = open_database()
    if clear:
        admin.set_endpoint_policy(db, owner_client_id, None)
        click.echo("cleared: the workers' default applies")
        return
    current = admin.endpoint_policy(db, owner_client_id)
    base = (current or EndpointPolicy()).model_dump()
    changes: dict[str, Any] = {}
    if failure_threshold is not None:
        changes["failure_threshold"] = failure_threshold
    if disable_after is not None or never_disable:
        changes["disable_after"] = None if never_disable else disable_after
    if probe_interval is not None:
        changes["probe_interval"] = {**base["probe_interval"], "first": probe_interval}
    if changes:
        current = EndpointPolicy(**{**base, **changes})
        admin.set_endpoint_policy(db, owner_client_id, current)
    click.echo(current.model_dump_json() if current is not None else "no policy of its own: the workers' default")


@callbacks.group()
def secret() -> None:
    """Signing secrets of an owner's callbacks (Standard Webhooks)."""


@secret.command()
@click.option("--owner", "owner_client_id", required=True, help="The owner whose callbacks are signed.")
@click.option(
    "--previous-valid-for",
    type=FloatRange(0, admin.MAX_PREVIOUS_VALID_FOR),
    default=86400.0,
    show_default=True,
    help="Seconds the previous secret keeps signing too.",
)
@click.option("--ed25519", is_flag=True, help="An ed25519 signing key (v1a signatures) instead of an HMAC secret.")
def rotate(owner_client_id: str, previous_valid_for: float, ed25519: bool) -> None:
    """Make a new signing secret for the owner and print what receivers verify with: the HMAC secret (the only time
    it is shown), or with --ed25519 the public key (the private key is never shown)."""
    kind = "ed25519" if ed25519 else "hmac"
    click.echo(admin.rotate_secret(open_database(), owner_client_id, previous_valid_for=previous_valid_for, kind=kind))
    if ed25519:
        click.echo("receivers verify the v1a signatures with this public key", err=True)


@secret.command()
@click.option("--owner", "owner_client_id", required=True)
@click.option("--all", "everything", is_flag=True, help="Retire the newest too: the owner's calls go unsigned.")
def retire(owner_client_id: str, everything: bool) -> None:
    """Stop signing with the owner's previous secret (--all: with any)."""
    count = admin.retire_secrets(open_database(), owner_client_id, keep_newest=not everything)
    click.echo(f"retired {count} secrets")


@secret.command(name="list")
@click.option("--owner", "owner_client_id", required=True)
def list_secrets(owner_client_id: str) -> None:
    """The owner's secrets, newest first: ids, kinds, times and an ed25519 key's public key, never the secrets."""
    found = admin.signing_secrets(open_database(), owner_client_id)
    if not found:
        click.echo("no secrets: the owner's callbacks are not signed")
    for s in found:
        state = "active" if s.active else "retired" if s.retired_at else "expired"
        expires = s.expires_at.isoformat() if s.expires_at else "-"
        line = f"{s.secret_id}\t{s.kind}\t{state}\tcreated {s.created_at.isoformat()}\texpires {expires}"
        click.echo(f"{line}\tpublic key {s.public_key}" if s.public_key else line)


@callbacks.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8765, show_default=True, type=click.IntRange(1, 65535))
def sink(host: str, port: int) -> None:
    """Run a local endpoint that prints every callback it receives (try callbacks without a service)."""
    from cmb_dagster.callbacks.sink import CallbackSink

    server = CallbackSink(host, port, keep=False)
    server.on_call.append(
        lambda call: click.echo(f"{datetime.now(UTC).isoformat()} {call.path} {json.dumps(call.body)}")
    )
    server.start()
    click.echo(f"listening on {server.url}; POST callbacks there (Ctrl-C stops)", err=True)
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    done.wait()
    server.stop()
