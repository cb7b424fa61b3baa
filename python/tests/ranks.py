"""Ranks of a multi-process test: a free port on the loopback, and the ranks' processes started,
waited for with a timeout (a rank that hangs in a collective is a failure, not a stuck suite) and
never left running."""

import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(commands, timeout: float, env=None) -> list:
    """Runs one process per command (a rank each), and returns their exit codes in order, or
    ``"hung"`` for a rank still running ``timeout`` seconds after the start (one deadline for
    all: then killed, as is every rank still running when this returns). ``env``: one
    environment for all, or a list of one per command."""
    deadline = time.monotonic() + timeout
    envs = env if isinstance(env, list) else [env] * len(commands)
    procs = [subprocess.Popen(cmd, env=e) for cmd, e in zip(commands, envs)]
    try:
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append("hung")
        return codes
    finally:
        for proc in procs:  # a rank that hangs must not outlive the test
            if proc.poll() is None:
                proc.kill()


def run_worker(worker: str, out_dir, timeout: float, *args: str, world: int = 2, env=None):
    """Runs ``world`` ranks of the script ``worker`` (``python WORKER PORT RANK WORLD *ARGS OUT``,
    OUT a file of ``out_dir`` per rank, on a free port, in ``env`` as ``run_ranks`` takes it);
    returns their exit codes (as ``run_ranks``) and their OUT files."""
    port = str(free_port())
    outs = [out_dir / f"rank{r}.out" for r in range(world)]
    codes = run_ranks([[sys.executable, worker, port, str(r), str(world), *args, str(outs[r])] for r in range(world)], timeout, env)
    return codes, outs


def assert_workers_pass(worker: str, out_dir, timeout: float, *args: str, world: int = 2) -> None:
    """Runs ``run_worker`` for a worker that writes one line per failure to its OUT (``report``)
    and asserts that every rank exited 0, wrote its OUT, and found nothing."""
    codes, outs = run_worker(worker, out_dir, timeout, *args, world=world)
    failures = [line for o in outs if o.exists() for line in o.read_text().splitlines()]
    assert codes == [0] * world and all(o.exists() for o in outs), (codes, failures)
    assert not failures, "\n".join(failures)


def report(out: str, failures) -> None:
    """A worker's failures, one line each, to its OUT (``assert_workers_pass`` reads them)."""
    with open(out, "w") as f:
        f.write("".join(line + "\n" for line in failures))


def leave(out: str, failures, clean: bool = True) -> None:
    """A gloo worker's end: its failures to OUT (``report``), then ``exit_process``."""
    report(out, failures)
    exit_process(clean)


def exit_process(clean: bool = True) -> None:
    """A rank's end: with ``clean``, every rank through its collectives and the process group
    destroyed (where one was started); then the process leaves with status 0 without the
    interpreter's teardown, where gloo's threads can still abort it (pytorch/pytorch#190489,
    seen in CI with four ranks even after a barrier, and under Lightning's FSDP2 after a
    destroy). Write everything the test reads before calling it."""
    import os

    import torch.distributed as dist

    if clean and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gloo_worker(port: str, rank: int, world: int, out: str, body) -> None:
    """One rank of a gloo test: the process group joined, ``body(failures)`` run (an exception
    of it reported as this rank's failure: the other ranks may hang on it, the test's timeout),
    then ``leave``."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures = []
    try:
        body(failures)
    except Exception as e:
        failures.append(f"rank {rank}: {type(e).__name__}: {e}")
    leave(out, failures)


def twin_grads(sharded, whole, grads, shard) -> None:
    """One step's gradients ``grads`` (None: no gradient) given to a sharded run's parameters
    (``shard(g, i)``: parameter ``i``'s piece of ``g`` on this rank) and to the whole run's."""
    for i, (p, q, g) in enumerate(zip(sharded, whole, grads)):
        p.grad = None if g is None else shard(g, i)
        q.grad = None if g is None else g.clone()
