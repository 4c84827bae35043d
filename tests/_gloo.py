"""Run a function on N local torch.distributed (gloo) ranks and collect what each returns.

Shared by the distributed tests: ``run_on_gloo_ranks(fn, world, *args)`` spawns ``world``
processes, initialises a gloo group over TCP on a free localhost port in each, calls
``fn(rank, world, *args)`` (a module-level function, so spawn can pickle it) and returns the
ranks' JSON-able return values, in rank order.
"""

from __future__ import annotations

import datetime
import json
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOO_AVAILABLE = dist.is_available() and dist.is_gloo_available()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_entry(rank: int, fn: Callable[..., Any], world: int, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        result = fn(rank, world, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(fn: Callable[..., Any], world: int = 2, *args: Any) -> list[Any]:
    """``[fn(0, world, *args), …, fn(world-1, world, *args)]``, each computed on its own gloo rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_entry, args=(fn, world, free_port(), out_dir, args), nprocs=world, join=True)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
