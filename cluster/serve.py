"""`radixmesh serve`: place the workers and the router on Ray, print the endpoint, serve until
SIGTERM / Ctrl-C, drain, exit 0.

    RAY_ADDRESS set (e.g. `ray job submit -- radixmesh serve`)  -> that cluster
    otherwise                                                   -> an embedded Ray on 127.0.0.1
    workers: one per GPU (num_gpus=1 each), or `workers.count` CPU workers (default 2)
    router:  the public gRPC endpoint (config `router.host:port`, default 127.0.0.1:50051) and
             the HTTP API (`router.http_port`, default 8000)

Both are restartable Ray actors: a dead worker is restarted and rejoins the router; a dead
router is restarted on the same port. A router Ray cannot bring back (restarts used up, a
constructor that fails) ends serving: one line says so, the workers are drained, exit 1. The
same when a stop signal finds the router dead: the workers are still drained. An actor that
cannot start at all (a model it cannot load, a port taken) ends `serve` with one line naming
it and its error, exit 1.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from rich.console import Console
from rich.markup import escape

from cluster.config import ClusterConfig, ConfigError, check_worker_ports, engine_options
from cluster.ray_runtime import actor_name, connect, gpu_count
from cluster.ray_token import PATH_ENV, embedded_cluster_token
from cluster.router_actor import RouterActor
from cluster.router_watch import RouterWatch, first_line
from worker.actor import WorkerActor

console = Console(stderr=True)


def worker_names(count: int) -> list[str]:
    return [f"worker-{i}" for i in range(count)]


def place_workers(config: ClusterConfig, fixed: bool = False) -> dict[str, Any]:
    """The worker actors, placed. `fixed`: the Ray cluster cannot grow (serve's embedded one),
    so workers it can never hold are refused rather than waited for."""
    gpus = gpu_count()
    device = config.model.device
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    count = config.workers.count or (gpus if device == "cuda" else 2)
    if count < 1:  # not an error for Ray: serve would place no worker and never route
        raise ConfigError(
            "model.device is cuda but the Ray cluster has no GPU: set model.device to cpu, or "
            "workers.count to the GPUs an autoscaler will add"
        )
    check_worker_ports(config, count)
    missing = missing_resources(config, device, count)
    if missing and fixed:  # Ray would keep them pending, and serve would wait forever
        raise ConfigError(missing)
    if missing:
        console.print(
            f"[yellow]radixmesh serve:[/] waiting for the Ray cluster to grow: {missing}",
            soft_wrap=True,
        )
    metrics = config.metrics
    handles = {}
    for index, name in enumerate(worker_names(count)):
        options: dict[str, Any] = {
            "name": actor_name(name),
            "max_restarts": config.workers.max_restarts,
            "num_cpus": config.workers.cpus_per_worker,
            "num_gpus": 1 if device == "cuda" else 0,
        }
        port = None
        if metrics.enabled:
            port = metrics.worker_port + index if metrics.worker_port else 0
        handles[name] = (
            ray.remote(WorkerActor)
            .options(**options)
            .remote(
                name,
                config.model.source,
                engine_options(config),
                device,
                config.model.dtype,
                config.workers.host,
                port,
                max(1, int(config.workers.cpus_per_worker)),
                weights=config.model.weights_for(device),
                metrics_host=metrics.host,
            )
        )
    return handles


def missing_resources(config: ClusterConfig, device: str, count: int) -> str | None:
    """What `count` workers need beyond all the Ray cluster has, in all its nodes together
    (None: it has that much)."""
    have = ray.cluster_resources()
    per_worker, cpus = config.workers.cpus_per_worker, have.get("CPU", 0)
    if count * round(per_worker * 1e4) > round(cpus * 1e4):  # Ray's units: no float slack
        return (
            f"{count} workers of {per_worker:g} CPUs (workers.count, workers.cpus_per_worker) "
            f"need {count * per_worker:g} CPUs; the Ray cluster has {cpus:g}: lower them, or "
            "serve on a Ray cluster with more"
        )
    if device == "cuda" and count > have.get("GPU", 0):
        return (
            f"{count} CUDA workers (workers.count) need {count} GPUs; the Ray cluster has "
            f"{have.get('GPU', 0):g}: lower workers.count, or set model.device to cpu"
        )
    return None


def place_router(config: ClusterConfig, workers: dict[str, Any]) -> Any:
    """The router actor. It is given the workers' names, not their handles: a handle among an
    actor's constructor arguments puts them in the object store, from which a restart would
    have to read them back (Ray logs an error saying so)."""
    options: dict[str, Any] = {
        "name": actor_name("router"),
        "max_restarts": config.router.max_restarts,
        "num_cpus": 0,
    }
    if config.router.resource:
        options["resources"] = {config.router.resource: 0.01}
    return ray.remote(RouterActor).options(**options).remote(config.to_dict(), list(workers))


def serve(config: ClusterConfig, stop: threading.Event | None = None) -> int:
    """0 after a drain on SIGTERM / Ctrl-C (or `stop`); 1 when the router died for good, or
    an actor could not start."""
    stop = stop or threading.Event()
    check_token_file()
    started = connect()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            workers, router, endpoint, http_url = start(config, fixed=started)
        except StartFailed as err:
            console.print(f"[red]radixmesh serve:[/] {escape(str(err))}", soft_wrap=True)
            return 1
        print(f"radixmesh serving on {endpoint}", flush=True)
        if http_url is not None:
            print(f"OpenAI and Anthropic APIs on {http_url}/v1", flush=True)
        watch = RouterWatch(router)
        dead = None
        while dead is None and not stop.wait(0.5):
            dead = watch.dead()
        return shut_down(config, router, workers, dead)
    finally:
        if started:
            ray.shutdown()


def check_token_file() -> None:
    """Make the token an embedded Ray cluster needs before Ray starts (`connect` finds it
    there): a RAY_AUTH_TOKEN_PATH that is a directory, or a file that is not text, is a
    ConfigError naming it, as `radixmesh ray-token` says, not a traceback."""
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return  # a cluster of the user's has its own token
    try:
        embedded_cluster_token()
    except (OSError, UnicodeDecodeError) as err:
        where = f"{PATH_ENV} {os.environ[PATH_ENV]}" if os.environ.get(PATH_ENV) else "Ray token"
        raise ConfigError(f"{where}: {err}") from None


class StartFailed(Exception):
    """An actor's constructor failed; the message says which actor and why."""


def start(
    config: ClusterConfig, fixed: bool = False
) -> tuple[dict[str, Any], Any, str, str | None]:
    """Place the workers, then the router, and wait for each to start: (workers, router, gRPC
    endpoint, HTTP URL). When a constructor fails (a model it cannot load, a port taken), what
    was placed is killed and StartFailed says which actor failed, and why."""
    resource = config.router.resource
    if fixed and resource and resource not in ray.cluster_resources():
        raise ConfigError(  # Ray would keep the router pending: serve would wait forever
            f"router.resource {resource!r}: no node of the embedded Ray cluster offers it; "
            "unset it, or serve on a Ray cluster whose head offers it"
        )
    workers: dict[str, Any] = {}
    router = None
    starting = "the workers"
    try:
        with console.status("starting workers (loading the model)..."):
            workers = place_workers(config, fixed)
            for name, handle in workers.items():
                starting = name
                info = ray.get(handle.describe.remote())
                console.print(
                    f"{name}: gRPC {info['address']}, pid {info['pid']}, KV pool "
                    f"{info['kv_pages']:,} pages of {info['page_size']} "
                    f"({info['kv_bytes'] / 1e9:.2f} GB: {escape(info['kv_sized_by'])})"
                )
        with console.status("starting the router..."):
            starting = "the router"
            router = place_router(config, workers)
            endpoint = ray.get(router.endpoint.remote())
            http_url = ray.get(router.http_url.remote())
    except RayActorError as err:  # killed now, not whenever the last handle is collected
        for handle in [*workers.values(), *([router] if router is not None else [])]:
            ray.kill(handle, no_restart=True)
        raise StartFailed(f"{starting} could not start: {start_failure(err)}") from None
    return workers, router, endpoint, http_url


def start_failure(err: RayActorError) -> str:
    """Why an actor did not start: the exception its constructor raised, as a traceback ends
    with it (`Type: message`, its lines joined), or the first line of Ray's message when the
    actor died otherwise."""
    lines = str(err).splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    if not err.actor_init_failed or not frames:
        return first_line(err)
    after = lines[frames[-1] + 1 :]  # the frame's code and carets are indented; the error not
    start = next((i for i, line in enumerate(after) if line and not line[0].isspace()), len(after))
    return " ".join(line.strip() for line in after[start:] if line.strip()) or first_line(err)


def shut_down(config: ClusterConfig, router: Any, workers: dict[str, Any], dead: str | None) -> int:
    """Drain the router (unless it is dead) and every worker that answers, then kill them all;
    one line on how it ended. 0, or 1 when the router was dead."""
    timeout = config.drain_timeout_s
    if dead is not None:
        console.print(f"[red]radixmesh serve:[/] the router died for good ({escape(dead)})")
    console.print("draining...")
    drained = True
    if dead is None:
        try:  # a restarting router answers once it is back; a dead one fails at once
            drained = ray.get(router.drain.remote(timeout), timeout=timeout + 120)
        except (RayActorError, GetTimeoutError) as err:
            dead = first_line(err)
    for handle in workers.values():
        try:
            drained &= ray.get(handle.drain.remote(timeout), timeout=timeout + 120)
        except (RayActorError, GetTimeoutError):  # a dead worker has nothing to drain
            drained = False
    for handle in [router, *workers.values()]:
        ray.kill(handle, no_restart=True)
    if dead is not None:
        console.print(f"stopped: the workers were drained, the router was dead ({escape(dead)})")
        return 1
    console.print("stopped" + ("" if drained else " (some requests were cut at the deadline)"))
    return 0


def main(config_path: str | None) -> int:
    """0 after a drain; 1 when the router died for good; 2, with one line naming the key, for a
    config it cannot serve."""
    try:
        return serve(ClusterConfig.load(config_path))
    except ConfigError as err:
        console.print(f"[red]radixmesh serve:[/] {escape(str(err))}", soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
