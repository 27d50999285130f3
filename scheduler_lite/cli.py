"""scheduler-lite: the command line of the daemon (docs/scheduler.md). Parse, validate, build, run.

Every command but `serve` and `sim` is a request to the daemon over its Unix socket
(scheduler_lite.client): the daemon is the only writer of the store and identifies the caller
from the socket itself. Without a running daemon these commands say so.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import time
import unicodedata
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

from scheduler_lite.client import AnswerLost, ClientError, NoDaemon, call, cluster_status, job_record
from scheduler_lite.config import CONFIG_ENV, Config, check_accounts, resolve_config
from scheduler_lite.devices import DeviceError
from scheduler_lite.isolation import SESSION_VARIABLES
from scheduler_lite.launcher import describe_exit
from scheduler_lite.model import JobKind
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.status import ClusterStatus, JobOnGpu
from scheduler_lite.storage import JobRecord, JobStatus, StorageError
from scheduler_lite.storage.base import seq_of
from scheduler_lite.submission import SubmitError, quota_warning
from scheduler_lite.wire import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, UNPRINTABLE, plain
from tf_antman.units import format_bytes, parse_bytes

PROG = "scheduler-lite"
EXAMPLES = f"""\
examples:
  export {CONFIG_ENV}=examples/scheduler.toml   # every command below, `serve` included, reads it
  {PROG} serve &
  {PROG} submit --tenant research --type guarantee -- .venv/bin/python examples/colocate_job.py --steps 500
  {PROG} submit --tenant batch --type opportunistic --memory 1GiB --env SEED=3 -- python train.py
  {PROG} list --state running
  {PROG} status --json
  {PROG} logs job-3 --follow
  {PROG} cancel job-3
  {PROG} sim --workload paper --jobs 200

The config file is --config FILE, else ${CONFIG_ENV}, else the packaged default
(one emulated 4 GiB GPU, tenant "default", state in ~/.local/state/scheduler-lite).
"""


class UserError(Exception):
    """A mistake the user can fix: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes read like every other one: one line `scheduler-lite: error: ...`,
    exit status 2, instead of the usage block and `scheduler-lite submit: error: ...`. The
    sub-commands' parsers are of this class too (add_subparsers passes it on)."""

    def error(self, message: str) -> NoReturn:
        _usage_error(self.prog, message)


def _usage_error(prog: str, message: str) -> NoReturn:
    """argparse's exit (SystemExit(2)); `prog` is the command whose --help explains the options."""
    # `unrecognized arguments` quotes the argv as given: a newline in it must not break the line.
    print(f"{PROG}: error: {_printable(message)} (see '{prog} --help')", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "sim":  # all that follows `sim` goes to the simulator's own parser, its --help included
        from scheduler_lite.sim import main as sim_main

        return sim_main(unknown)
    if unknown:  # the sub-command's options are the ones to read about, not the top level's
        _usage_error(f"{PROG} {args.command}" if args.command else PROG, "unrecognized arguments: " + " ".join(unknown))
    if args.command is None:
        parser.print_help()
        return 2
    try:
        config = resolve_config(args.config)
        args.run(config, args)
        return 0
    except (UserError, ConfigError, SubmitError, StorageError, DeviceError, ClientError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `logs job-3 | head`: the reader has what it wanted. Python would complain again when it
        # flushes stdout at exit, so stdout goes to /dev/null; the status is the shell's for SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        print(f"{PROG}: error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# An interrupted submit (the answer lost: the daemon died or restarted) is sent again with the
# same request id for this long, every SUBMIT_RETRY_PAUSE_S: the daemon answers with the job
# recorded the first time, or records it now. Then the CLI gives up, saying how to check.
SUBMIT_RETRY_S: Final = 30.0
SUBMIT_RETRY_PAUSE_S: Final = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG, description="AntMan-style GPU sharing for the GPUs of one workstation.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # --config and --json before the command or after it (`--json list`, `list --json`): a
    # sub-command's own only replace the top level's when given (SUPPRESS). What follows submit's
    # first positional argument is the job's (argparse.REMAINDER): `submit python train.py --json`
    # keeps `--json` for train.py.
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    for parser in (p, common):
        parser.add_argument("--config", metavar="FILE", help=f"TOML config (default: ${CONFIG_ENV}, else the "
                                                             "packaged default)")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, run: Callable[[Config, argparse.Namespace], None], help: str,
                epilog: str = "") -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, epilog=epilog or None, parents=[common],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.set_defaults(run=run)
        return sp

    sp = command("serve", cmd_serve, "run the daemon in the foreground until SIGTERM/SIGINT",
                 "Running jobs keep running when the daemon stops; the next start re-adopts them.")
    sp.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    sp.add_argument("--metrics-port", type=int, metavar="PORT",
                    help="serve Prometheus metrics on this TCP port (docs/scheduler.md, \"Metrics\")")
    sp.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDR",
                    help="address the metrics endpoint listens on (default 127.0.0.1)")

    sp = command("submit", cmd_submit, "queue a job; prints its id",
                 f"example:\n  {PROG} submit --tenant research --gpus 1 --type guarantee -- python train.py --lr 0.1")
    sp.add_argument("--tenant", help="tenant (default: the only one you may submit to; `tenants` lists them)")
    sp.add_argument("--gpus", type=int, default=1, help="GPUs of the gang (default 1)")
    sp.add_argument("--type", dest="kind", default="auto", choices=[k.value for k in JobKind],
                    help="guarantee: uses quota; opportunistic: never does; auto: guarantee unless it "
                         "would wait long (default auto)")
    sp.add_argument("--workdir", help="working directory (default: the current one)")
    sp.add_argument("--env", action="append", default=[], metavar="K=V", help="environment variable (repeatable)")
    sp.add_argument("--memory", help="peak GPU memory per GPU, e.g. 2GiB, at most the GPU's (default: measured "
                                     "while it runs; until then the whole GPU)")
    sp.add_argument("--steps", type=int, help="steps the job will run: with its measured step time, its "
                                              "remaining time (auto jobs' queueing estimate)")
    sp.add_argument("--duration", type=float, metavar="SECONDS",
                    help="expected run time, when --steps is not known")
    sp.add_argument("--share", type=float, metavar="FRACTION",
                    help="share of one GPU the job needs, in (0, 1], e.g. 0.5 (its utilisation alone): an "
                         "opportunistic job goes only where the stated shares fit (default: none stated)")
    sp.add_argument("--restartable", action="store_true",
                    help="the command resumes from its own checkpoints: the scheduler may stop it (SIGTERM, "
                         "jobs.cancel_grace_s) and start it again on an idle GPU when it is held at a low share")
    sp.add_argument("--name", default="", help="a label shown by list")
    sp.add_argument("--request-id", metavar="ID",
                    help="this submission's id (1-64 of A-Z a-z 0-9 _ . : -; default: a new random one): the "
                         "same submit repeated with the same id answers the job recorded the first time")
    sp.add_argument("cmd", nargs=argparse.REMAINDER, metavar="[--] COMMAND ...",
                    help="the job's command; everything from its first word on is the job's, options included")

    sp = command("list", cmd_list, f"list the newest jobs ({DEFAULT_LIST_LIMIT} unless --limit or --all), oldest first",
                 f"The newest jobs are at the bottom. When older jobs are not shown, a line on stderr says how\n"
                 f"many. --json prints the same jobs as one JSON list (the line still goes to stderr).\n\n"
                 f"examples:\n  {PROG} list --state running --state queued\n  {PROG} list --limit 500\n"
                 f"  {PROG} list --all --json > jobs.json")
    sp.add_argument("--state", action="append", choices=[s.value for s in JobStatus],
                    help="only jobs in this state (repeatable)")
    shown = sp.add_mutually_exclusive_group()
    shown.add_argument("--limit", type=_at_least_one, default=DEFAULT_LIST_LIMIT, metavar="N",
                       help=f"show the newest N jobs (default {DEFAULT_LIST_LIMIT})")
    shown.add_argument("--all", action="store_true", help="show every job (asks the daemon page by page)")

    sp = command("show", cmd_show, "one job: its record and its events")
    sp.add_argument("job")

    sp = command("cancel", cmd_cancel, "cancel jobs: SIGTERM, SIGKILL after jobs.cancel_grace_s")
    sp.add_argument("jobs", nargs="+", metavar="JOB")

    command("status", cmd_status, "per GPU: jobs, memory limits and use, host fallback, compute shares, step times")

    sp = command("logs", cmd_logs, "print a job's stdout (or stderr)")
    sp.add_argument("job")
    sp.add_argument("--stderr", action="store_true", help="stderr instead of stdout")
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")

    command("tenants", cmd_tenants, "tenants with their quota and use")
    sub.add_parser("sim", help="the trace-driven simulator (scheduler-lite sim --help)", add_help=False)
    return p


# ----------------------------------------------------------------------------------------------
# Commands.


def cmd_serve(config: Config, args: argparse.Namespace) -> None:
    """Lock the state directory, open the store, serve the socket, tick; undone in reverse order."""
    from scheduler_lite.containment import ContainmentUnavailable
    from scheduler_lite.daemon import Daemon  # only `serve` runs the loop
    from scheduler_lite.metrics import MetricsUnavailable, start_metrics_server
    from scheduler_lite.server import Server
    from scheduler_lite.state_dir import DaemonLockedError, check_state_dir, lock_state_dir, secure_state_dir
    from scheduler_lite.storage import SqliteStorage

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    multi_user = os.geteuid() == 0
    check_state_dir(config)
    check_accounts(config)
    try:
        with contextlib.ExitStack() as undo:
            undo.callback(os.close, lock_state_dir(config.state_dir))  # first: a second `serve` is told another runs
            # The metrics endpoint before the daemon: constructing it takes over the store's jobs
            # (re-adopts, requeues, stops), which a bad --metrics-port or --metrics-address must not
            # do before it is refused. Scrapes find no snapshot until the server below publishes one.
            served: list[Server] = []
            if args.metrics_port is not None:
                undo.callback(start_metrics_server(args.metrics_port, args.metrics_address,
                                                   lambda: served[0] if served else None))
                logging.getLogger("scheduler_lite").info("metrics on http://%s:%d/metrics", args.metrics_address,
                                                         args.metrics_port)
            secure_state_dir(config, multi_user)
            storage = SqliteStorage(config.db_path)
            undo.callback(storage.close)
            secure_state_dir(config, multi_user)  # again: the -wal and -shm files exist now
            if config.cluster is not None:  # cluster mode: the global scheduler (imports Ray)
                from scheduler_lite.cluster.host import cluster_daemon
                daemon: Daemon = cluster_daemon(config, storage)
            else:
                daemon = Daemon(config, storage)
            server = Server(daemon, config)
            served.append(server)
            server.start()
            undo.callback(server.close)
            daemon.serve(between_ticks=server.serve_requests)
    except (DaemonLockedError, MetricsUnavailable, ContainmentUnavailable) as e:
        raise UserError(str(e)) from None


def cmd_submit(config: Config, args: argparse.Namespace) -> None:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError("no command: give it after '--', e.g. submit -- python train.py")
    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--env {item!r}: expected KEY=VALUE")
        env.append([key, value])
    memory = None
    if args.memory is not None:
        try:
            memory = parse_bytes(args.memory)
        except ValueError as e:
            raise UserError(f"--memory: {e}") from None
    workdir = Path(args.workdir or os.getcwd()).absolute()
    _check_command(command[0], workdir, dict(env))
    session = {k: os.environ[k] for k in SESSION_VARIABLES if k in os.environ}
    result = _submit(config, args.request_id or uuid.uuid4().hex,
                     {"command": command, "tenant": args.tenant, "gpus": args.gpus, "kind": args.kind,
                      "workdir": str(workdir), "env": env, "session_env": session, "memory_bytes": memory,
                      "name": args.name, "steps": args.steps, "duration_s": args.duration, "share": args.share,
                      "restartable": args.restartable})
    if args.json:
        _print_json(result)
    else:
        print(result["id"])


def _submit(config: Config, request_id: str, request: dict[str, Any]) -> dict[str, Any]:
    """The submit request, sent again with the same request id while its answer is lost: safe,
    since the daemon records one job per request id and submitter (a repeat is answered with it)."""
    give_up = time.monotonic() + SUBMIT_RETRY_S
    lost: AnswerLost | None = None
    told = False
    while True:
        try:
            result: dict[str, Any] = call(config, "submit", request_id=request_id, **request)
            return result
        except AnswerLost as e:
            lost = e
        except NoDaemon:
            if lost is None:  # never sent: nothing can have been recorded
                raise
        if time.monotonic() >= give_up:
            raise UserError(f"{lost} during submit: the job may have been recorded. Check with `{PROG} list`, or "
                            f"repeat this submit with --request-id {request_id}: it answers with the job recorded "
                            "the first time, or records it now") from None
        if not told:  # once: the daemon may take a while to come back
            print(f"{PROG}: {lost}; sending the submit again with the same request id ({request_id}) for up to "
                  f"{SUBMIT_RETRY_S:g} s", file=sys.stderr)
            told = True
        time.sleep(SUBMIT_RETRY_PAUSE_S)


def cmd_list(config: Config, args: argparse.Namespace) -> None:
    found, remaining = _newest_jobs(config, args.state, None if args.all else args.limit)
    if args.json:
        _print_json(found)
    else:
        jobs = [job_record(j) for j in found]
        rows = [[j.id, j.name or "-", j.tenant, j.user or "-", str(j.kind), str(j.role) if j.role else "-", _state(j),
                 ",".join(map(str, j.placement)) if j.placement else f"({j.num_gpus})",
                 _clock(j.submit_time), _duration(j), _command(j.command, j.workdir)] for j in jobs]
        _table(["ID", "NAME", "TENANT", "USER", "TYPE", "ROLE", "STATE", "GPUS", "SUBMITTED", "RUNTIME", "COMMAND"],
               rows)
    if remaining:
        sys.stdout.flush()  # the note after the table, where a terminal shows both
        which = "matching job" if args.state else "job"
        print(f"({remaining:,} older {which}{'s' if remaining != 1 else ''} not shown: --limit N shows the newest N, "
              "--all every one)", file=sys.stderr)


def _newest_jobs(config: Config, states: list[str] | None, count: int | None) -> tuple[list[dict[str, Any]], int]:
    """The newest `count` jobs (every one when None) in `states`, oldest first, and how many older
    ones there are: one `list` request per page of at most MAX_LIST_LIMIT, each page's cursor the
    previous page's next_cursor (jobs submitted meanwhile do not shift it)."""
    pages: list[list[dict[str, Any]]] = []
    got, cursor = 0, None
    while True:
        size = MAX_LIST_LIMIT if count is None else min(MAX_LIST_LIMIT, count - got)
        try:
            page = call(config, "list", states=states, limit=size, cursor=cursor)
        except ClientError as e:
            if str(e).startswith("argument 'limit' is unknown"):
                raise ClientError(f"{e} (the daemon is older than this client and does not page `list`: restart it "
                                  "with this scheduler-lite)") from None
            raise
        pages.append(page["jobs"])
        got += len(page["jobs"])
        if not page["more"] or count is not None and got >= count:
            return [job for jobs in reversed(pages) for job in jobs], page["remaining"]
        if not page["jobs"] or not _older(page["next_cursor"], cursor):  # else it would ask forever
            raise ClientError(f"the daemon's list answers do not move on (next_cursor {page['next_cursor']!r} after "
                              f"{cursor!r}): is it the same scheduler-lite version?")
        cursor = page["next_cursor"]


def _older(cursor: object, than: str | None) -> bool:
    try:
        return than is None or seq_of(cursor) < seq_of(than)
    except StorageError:
        return False


def _at_least_one(text: str) -> int:
    """--limit: ASCII digits (int() also reads '1_0' and other scripts' digits), at least 1."""
    if not re.fullmatch(r"0*[1-9][0-9]{0,99}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: accepted an integer >= 1 (--all: every job)")
    return int(text)


def cmd_show(config: Config, args: argparse.Namespace) -> None:
    found = call(config, "show", job=args.job)
    if args.json:
        _print_json(found)
        return
    job = job_record(found["job"])
    fields = [
        ("id", job.id), ("name", job.name or "-"), ("tenant", job.tenant), ("user", job.user or "-"),
        ("type", str(job.kind)),
        ("role", str(job.role) if job.role else "-"), ("state", _state(job)), ("gpus", str(job.num_gpus)),
        ("placement", ",".join(map(str, job.placement)) or "-"), ("command", " ".join(job.command)),
        ("workdir", job.workdir), ("memory", format_bytes(job.memory_bytes) if job.memory_bytes else "whole GPU"),
        ("share", "-" if job.requested_share is None else f"{job.requested_share:g}"),
        ("restart", "allowed (--restartable)" if job.restartable else "no"),
        ("env", " ".join(f"{k}={v}" for k, v in job.env) or "-"), ("submitted", _clock(job.submit_time)),
        ("started", _clock(job.started_at)), ("ended", _clock(job.ended_at)), ("runtime", _duration(job)),
        ("pid", str(job.pid) if job.pid else "-"),
        ("exit", describe_exit(job.exit_code, ran=job.started_at is not None) if job.state.done else "-"),
        ("reason", job.reason or "-"), ("job dir", job.job_dir or "-"),
    ]
    for p in found["placements"]:
        fields.append((f"gpu {p['gpu']}",
                       f"limit {format_bytes(p['memory_limit_bytes'])}, share {p['compute_share']:.2f}"))
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key:<{width}}  {_printable(value)}")
    if found["events"]:
        older = found.get("older_events_omitted") or 0  # a count; True from an older daemon
        print("\nevents:" if not older else
              f"\nevents (the newest {len(found['events'])}; {'older ones' if older is True else older} not shown):")
        _table(["TIME", "EVENT", "DETAIL"],
               [[_clock(e["time"]), e["kind"], " ".join(f"{k}={_value(v)}" for k, v in e["detail"].items())]
                for e in found["events"]])


def cmd_cancel(config: Config, args: argparse.Namespace) -> None:
    out = call(config, "cancel", jobs=list(args.jobs))
    if args.json:
        _print_json(out)
    else:
        for item in out:
            print(f"{item['id']}: {item['result']}")


def cmd_status(config: Config, args: argparse.Namespace) -> None:
    found = call(config, "status")
    if args.json:
        _print_json(found)
        return
    _print_status(cluster_status(found))
    _print_quota_warning(found["tenants"], len(found["gpus"]))
    for line in found.get("warnings") or ():  # jobs that do not cooperate (scheduler_lite.misbehaviour)
        print(f"WARNING: {_printable(str(line))}")
    contained = found.get("containment")  # absent from a daemon before containment, or in cluster mode
    if isinstance(contained, dict):
        print(f"\ncontainment: {'on' if contained.get('active') else 'OFF'}: {contained.get('detail')}")


def cmd_logs(config: Config, args: argparse.Namespace) -> None:
    offset = 0
    # The log's bytes as the job wrote them: the daemon's chunks end at arbitrary byte offsets
    # (mid-character in UTF-8), and a job's output need not be text at all.
    out = sys.stdout.buffer
    sys.stdout.flush()
    while True:
        chunk = call(config, "logs", job=args.job, stderr=args.stderr, offset=offset)
        if not chunk["started"]:
            if not args.follow:
                raise UserError(f"{args.job} has not started yet ({chunk['state']}): no logs")
        else:
            data = base64.b64decode(chunk["data"])
            out.write(data)
            out.flush()
            offset = chunk["offset"]
            if data:
                continue  # more may be there already
        if not args.follow or chunk["done"]:
            if not chunk["started"]:  # followed while queued, then cancelled or rejected
                print(f"{args.job} ended without starting ({chunk['state']}): no logs", file=sys.stderr)
            return
        time.sleep(0.5)


def cmd_tenants(config: Config, args: argparse.Namespace) -> None:
    # The `status` op, not `tenants`: its answer has the same tenants and the daemon's GPUs, which
    # the quota warning needs, and every daemon version gives both (the `tenants` op's answer, a
    # list, stays as it was for the scripts that read it).
    found = call(config, "status")
    tenants = found["tenants"]
    if args.json:
        _print_json(tenants)
        return
    _table(["TENANT", "GPU QUOTA", "QUOTA USED", "RUNNING", "QUEUED"],
           [[t[k] for k in ("name", "gpu_quota", "quota_used", "running", "queued")] for t in tenants])
    _print_quota_warning(tenants, len(found["gpus"]))


def _print_quota_warning(tenants: Sequence[dict[str, Any]], gpu_count: int) -> None:
    """The quotas and GPUs of the daemon's answer, not of this client's config file: the file may
    have been edited since the daemon started, and with nvml devices only the daemon knows its GPUs."""
    warning = quota_warning((t["gpu_quota"] for t in tenants), gpu_count)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# Helpers.


def _check_command(program: str, workdir: Path, env: dict[str, str]) -> None:
    if "/" in program:
        path = workdir / program  # an absolute program stays itself
        if not path.exists():
            where = "" if os.path.isabs(program) else f" (relative to --workdir {workdir})"
            raise UserError(f"command {program!r} not found{where}")
        # Checked here, as the submitting user: the job would only fail at its start (exit 126).
        if not path.is_file() or not os.access(path, os.X_OK):
            raise UserError(f"command {program!r} is not an executable file: chmod +x it, or name its "
                            f"interpreter first (e.g. bash {program})")
        return
    search = env.get("PATH", os.environ.get("PATH", os.defpath))
    if shutil.which(program, path=search) is None:
        raise UserError(f"command {program!r} not found on PATH")


def _value(v: object) -> object:
    """An event's value as a person reads it: a share of 0.15, not 0.15000000000000002 (the
    coordinator's arithmetic); --json keeps the stored value."""
    return f"{v:.6g}" if isinstance(v, float) else v


def _state(job: JobRecord) -> str:
    text = str(job.state)
    if job.cancel_requested and not job.state.done:
        text += " (cancelling)"
    elif job.state.done and job.state is not JobStatus.CANCELLED and job.exit_code not in (None, 0):
        text += f" ({describe_exit(job.exit_code)})"
    return text


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _duration(job: JobRecord) -> str:
    if job.started_at is None:
        return "-"
    seconds = int((job.ended_at if job.ended_at is not None else time.time()) - job.started_at)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _command(command: Sequence[str], workdir: str, width: int = 50) -> str:
    """The command in a column of `list`: the program by its name, paths under the job's workdir
    relative to it, so that the script shows (`/work/.venv/bin/python /work/train.py` filled the
    column with the interpreter's path; `show` has the whole command)."""
    words = [os.path.basename(w) if i == 0 and "/" in w else w for i, w in enumerate(command)]
    prefix = workdir.rstrip("/") + "/"
    words = [w[len(prefix):] if w.startswith(prefix) and len(w) > len(prefix) else w for w in words]
    text = " ".join(words)
    return text if len(text) <= width else text[: width - 3] + "..."


def _printable(text: str) -> str:
    """`text` on one line, control characters as Python escapes (\\n, \\t, \\x1b, \\u202e): a job's
    command may hold a newline, and no text a user gave may move the terminal's cursor or colour it."""
    if text.isprintable():  # the common case (False also for spaces but ' ', which stay as they are)
        return text
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in UNPRINTABLE else c
                   for c in text)


def _table(header: list[str], rows: list[list[Any]]) -> None:
    """Cells as str() gives them, escaped (_printable), in left-aligned columns."""
    if not rows:
        print("(none)")
        return
    cells = [[_printable(str(c)) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


# A job that has not written stats.json this long after its start is taken to run without
# tf-antman (TF itself starts in a few seconds; the agent writes its first stats at activation).
SILENT_JOB_S = 30.0


# A job whose stats are older than this (and than 20 of its steps) shows how long it has not
# stepped: held at share 0 it writes nothing, and its last step time looked like a healthy one.
STALE_STEPS_S = 5.0


def _step_time(j: JobOnGpu) -> str:
    if j.step_ms_median is None:
        return "-"
    if j.paused:
        return f"paused at step {j.step}"
    text = f"{j.step_ms_median:.1f} ms (step {j.step})"
    if j.last_step_ms is not None and j.last_step_ms > 2 * j.step_ms_median:
        text += f", last {j.last_step_ms:.0f} ms"  # slowed since: the median lags
    if j.stats_age_s is not None and j.stats_age_s > max(STALE_STEPS_S, 20 * j.step_ms_median / 1000):
        text += f", no step for {j.stats_age_s:.0f} s"
    return text


def _print_status(status: ClusterStatus) -> None:
    rows = []
    by_node = len({g.node for g in status.gpus}) > 1  # cluster mode: GPUs grouped by node
    last_node = None
    for g in sorted(status.gpus, key=lambda g: (g.node or "", g.id)) if by_node else status.gpus:
        util = "-" if g.utilisation is None else f"{g.utilisation:.0%}"
        head = [f"{g.id}", format_bytes(g.memory_bytes), g.nvlink_group, util]
        if by_node:
            head.insert(0, g.node if g.node != last_node else "")
            last_node = g.node
        if not g.jobs:
            rows.append([*head, "(idle)" if g.reserved_for is None else f"(reserved for {g.reserved_for})",
                         "", "", "", "", "", "", ""])
        for i, j in enumerate(g.jobs):
            limit = "-" if j.memory_limit_bytes is None else format_bytes(j.memory_limit_bytes)
            share = "-" if j.compute_share is None else f"{j.compute_share:.2f}"
            if j.target_memory_limit_bytes is not None and j.target_memory_limit_bytes != j.memory_limit_bytes:
                limit += f" -> {format_bytes(j.target_memory_limit_bytes)}"
            if j.target_compute_share is not None and j.target_compute_share != j.compute_share:
                share += f" -> {j.target_compute_share:.2f}"
            rows.append([*(head if i == 0 else [""] * len(head)), j.job_id, str(j.role), limit,
                         "-" if j.in_use_bytes is None else format_bytes(j.in_use_bytes),
                         "-" if j.host_in_use_bytes is None else format_bytes(j.host_in_use_bytes),
                         share, str(j.controls_pending), _step_time(j)])
    _table(["NODE"] * by_node + ["GPU", "MEMORY", "GROUP", "UTIL", "JOB", "ROLE", "LIMIT", "IN USE", "HOST", "SHARE", "PENDING",
            "STEP TIME"], rows)
    print("LIMIT and SHARE: in force, as the job reports them; '-> X': decided, not applied yet "
          "(PENDING: control files the job has not applied)")
    for g in status.gpus:
        for j in g.jobs:
            if j.stats_error:
                print(f"warning: {j.job_id}: stats.json refused: {_printable(j.stats_error)}")
            elif j.compute_share is None and j.running_s is not None and j.running_s >= SILENT_JOB_S:
                print(f"warning: {j.job_id} has run {j.running_s:.0f} s without writing stats.json: no limit "
                      "or share reaches it until it does. Either tf-antman is not active in it (is tf-antman "
                      "installed for the Python its command runs?) or it is still starting (the first PyTorch "
                      "job of a PyTorch install compiles tf-antman's op hook, about a minute); "
                      "`scheduler-lite logs JOB --stderr` shows its start")
    if status.queued:
        print(f"queued: {' '.join(status.queued)}")
    if status.absent_nodes:
        print(f"nodes not connected: {' '.join(status.absent_nodes)} (their GPUs are not served until they "
              "join; the serve log says why)")


def _print_json(value: Any) -> None:
    print(json.dumps(plain(value), indent=None, sort_keys=False))
