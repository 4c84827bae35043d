"""Paths that are not regular files, and files that declare more bytes than they hold (issue #29 §3).

* A FIFO, a symlink to ``/dev/zero``, a symlink loop and a dangling symlink given as a model, data,
  scenario or conditions file are named for what they are (never "file not found"), and nothing
  blocks: opening a FIFO for reading waits for a writer forever, so every call here runs under a
  deadline that unblocks the FIFO and fails the test if the call hung.
* A ``.npy`` whose header declares more bytes than the file holds, or more than the read budget
  (a sparse 10 GiB file: ``truncate`` makes it without using disk), is refused from its header,
  before any data is read, naming the file, the shape, the bytes and the fix.
* A zip-bomb ``.npz`` (a member whose declared size is over the budget, or more than deflate can
  expand to) is refused before anything is decompressed, naming the file and the member.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from _hostile import make_settings
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.loading import load_dataset, load_model, load_operational_data, read_array_file
from pytest_dnnsafety.files.parsing import NotRegularFile, open_regular
from pytest_dnnsafety.files.provenance import file_sha256, setting_origin
from pytest_dnnsafety.plugin.fixtures import load_scenario_table
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs and /dev/zero are POSIX")

CPU = torch.device("cpu")
GiB = 1 << 30


def deadline(call: Callable[[], Any], fifo: Path | None = None, seconds: float = 20.0) -> Any:
    """``call()``'s result or exception; fails (after unblocking ``fifo``) if it does not return in time."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:  # a writer that closes at once: the blocked reader sees EOF and returns
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            thread.join(5)
        pytest.fail(f"the call blocked for more than {seconds} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def make_path(root: Path, name: str, kind: str) -> tuple[Path, str]:
    """A ``kind`` of non-regular path at ``root/name`` and the words a message must use for it."""
    path = root / name
    if kind == "fifo":
        os.mkfifo(path)
        return path, f"{path} is a FIFO (named pipe"
    if kind == "dev_zero":
        path.symlink_to("/dev/zero")
        return path, f"{path} is a symlink to /dev/zero, a character device"
    if kind == "loop":
        path.symlink_to(root / (name + ".other"))
        (root / (name + ".other")).symlink_to(path)
        return path, f"{path} is a symlink loop"
    if kind == "dangling":
        path.symlink_to(root / "nowhere.bin")
        return path, f"{path} is a dangling symlink (to {str(root / 'nowhere.bin')!r}, which does not exist)"
    raise AssertionError(kind)


KINDS = ["fifo", "dev_zero", "loop", "dangling"]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    return tmp_path


# ------------------------------------------------------------------ settings that point at non-regular files


SETTINGS = {
    "model": ("model.pt", lambda s: load_model(s, CPU), "a model file"),
    "data": ("data.npz", load_dataset, "a data file: .npz (keys x, y)"),
    "operational_data": ("op.npy", load_operational_data, "a data file: .npz (key x)"),
    "scenarios": ("scenarios.csv", load_scenario_table, "a CSV file"),
    "conditions": ("conditions.toml", load_scenario_table, "a TOML file"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_setting_pointing_at_a_non_regular_file_names_what_it_is(root: Path, setting: str, kind: str) -> None:
    name, load, expected = SETTINGS[setting]
    path, words = make_path(root, name, kind)
    extra = {}
    if setting == "conditions":
        (root / "scenarios.csv").write_text("a\nx\n")
        extra = {"scenarios": "scenarios.csv"}
    settings = make_settings(root, **{setting: name}, **extra)
    with pytest.raises(ConfigError) as info:
        deadline(lambda: load(settings), fifo=path if kind == "fifo" else None)
    message = str(info.value)
    assert message.startswith(f"dnnsafety_{setting}={name!r} (from ini option dnnsafety_{setting} in ")
    assert words in message
    assert "not a regular file" in message
    assert "not found" not in message
    assert f"Fix: point dnnsafety_{setting} at {expected}" in message


def test_a_symlink_to_a_regular_file_is_followed(root: Path) -> None:
    np.savez(root / "real.npz", x=np.ones((2, 3), np.float32), y=np.array([0, 1]))
    (root / "data.npz").symlink_to(root / "real.npz")
    data = load_dataset(make_settings(root, data="data.npz"))
    assert len(data) == 2


# ------------------------------------------------------------------ the readers themselves never block


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", ["npy", "npz", "pt", "csv", "toml", "sha256"])
def test_readers_refuse_non_regular_files_without_blocking(root: Path, reader: str, kind: str) -> None:
    suffix = {"npy": ".npy", "npz": ".npz", "pt": ".pt", "csv": ".csv", "toml": ".toml", "sha256": ".bin"}[reader]
    path, words = make_path(root, "input" + suffix, kind)
    conditions = Conditions({"a": ["x"]})
    call = {
        "npy": lambda: read_array_file(path, "evaluation data"),
        "npz": lambda: read_array_file(path, "evaluation data"),
        "pt": lambda: read_array_file(path, "evaluation data"),
        "csv": lambda: ScenarioTable.from_csv(path, conditions),
        "toml": lambda: Conditions.from_toml(path),
        "sha256": lambda: file_sha256(path),
    }[reader]
    error = NotRegularFile if reader == "sha256" else DataError
    with pytest.raises(error) as info:
        deadline(call, fifo=path if kind == "fifo" else None)
    assert words in str(info.value)
    assert "not a regular file" in str(info.value)


def test_open_regular_opens_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(b"abc")
    with open_regular(tmp_path / "f.bin") as handle:
        assert handle.read() == b"abc"
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing.bin")


def test_setting_origin_of_a_fifo_records_no_digest_without_blocking(root: Path) -> None:
    path, _ = make_path(root, "data.npz", "fifo")
    origin = deadline(lambda: setting_origin(make_settings(root, data="data.npz"), ["data"]), fifo=path)
    assert origin["data"]["sha256"] is None


# ------------------------------------------------------------------ .npy headers that declare too much


def npy_header(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    """A version 1.0 .npy header declaring ``shape`` of ``dtype`` (padded as numpy pads it)."""
    text = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': {shape!r}, }}"
    pad = 64 - (10 + len(text) + 1) % 64
    text += " " * pad + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


def test_sparse_10_gib_npy_is_refused_from_its_header_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "big.npy"
    shape = (10 * GiB // 4 // 1024, 1024)
    with open(path, "wb") as handle:
        handle.write(npy_header(shape))
        handle.truncate(len(npy_header(shape)) + 10 * GiB)  # sparse: no disk used
    start = time.perf_counter()
    with pytest.raises(DataError) as info:
        deadline(lambda: read_array_file(path, "evaluation data (dnnsafety_data='big.npy')"), seconds=60)
    seconds = time.perf_counter() - start
    message = str(info.value)
    assert seconds < 5, f"refused after {seconds:.1f} s: the data was read before the header was checked"
    assert message.startswith("evaluation data (dnnsafety_data='big.npy'): ")
    assert str(path) in message
    assert f"shape {shape}" in message and "float32" in message
    assert "10.0 GiB (10,737,418,240 bytes)" in message
    assert "budget" in message and "Fix:" in message and "DataLoader" in message


def test_npy_header_declaring_more_than_the_file_holds_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "liar.npy"
    path.write_bytes(npy_header((1_000_000, 1_000_000)) + b"\0" * 100)
    with pytest.raises(DataError) as info:
        deadline(lambda: read_array_file(path, "evaluation data"), seconds=30)
    message = str(info.value)
    assert str(path) in message
    assert "shape (1000000, 1000000)" in message
    assert "4,000,000,000,000 bytes" in message and "holds 100 bytes" in message
    assert "Fix: write it again with np.save(path, x)" in message


def test_npy_under_the_budget_loads(tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "x.npy", x)
    assert np.array_equal(read_array_file(tmp_path / "x.npy", "data"), x)
    with pytest.raises(DataError, match=r"budget of 40 bytes"):
        read_array_file(tmp_path / "x.npy", "data", budget=40)


def test_pt_data_file_over_the_budget_is_refused_before_torch_reads_it(tmp_path: Path) -> None:
    torch.save({"x": torch.zeros(64, 64)}, tmp_path / "d.pt")
    with pytest.raises(DataError) as info:
        read_array_file(tmp_path / "d.pt", "evaluation data", budget=1024)
    assert str(tmp_path / "d.pt") in str(info.value) and "budget of 1,024 bytes" in str(info.value)


# ------------------------------------------------------------------ .npz zip bombs


def bomb(path: Path, size: int, name: str = "x.npy") -> None:
    """An .npz whose member ``name`` is a valid .npy of ``size`` bytes of zeros, deflated (~1000:1)."""
    header = npy_header((size // 4,))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open(name, "w", force_zip64=True) as member:
            member.write(header)
            block = bytes(1 << 20)
            left = size
            while left > 0:
                member.write(block[: min(left, len(block))])
                left -= len(block)


def test_npz_bomb_over_the_budget_is_refused_before_decompressing(tmp_path: Path) -> None:
    path = tmp_path / "bomb.npz"
    bomb(path, 256 << 20)
    assert path.stat().st_size < 1 << 20
    with pytest.raises(DataError) as info:
        read_array_file(path, "evaluation data", budget=64 << 20)
    message = str(info.value)
    assert str(path) in message and "'x.npy'" in message
    assert "256.0 MiB" in message and "budget of 64.0 MiB" in message
    assert ":1" in message  # the compression ratio
    assert "Fix:" in message


def test_npz_member_declaring_more_than_deflate_can_expand_is_refused(tmp_path: Path) -> None:
    """A forged central directory: the member claims 1 TiB from a few hundred compressed bytes."""
    path = tmp_path / "forged.npz"
    np.savez_compressed(path, x=np.zeros(1000, np.float32))
    data = bytearray(path.read_bytes())
    central = data.rfind(b"PK\x01\x02")
    real = struct.unpack_from("<I", data, central + 24)[0]
    struct.pack_into("<I", data, central + 24, 0xFFFFFFF0)  # uncompressed size in the central directory
    path.write_bytes(bytes(data))
    assert real < 0xFFFFFFF0
    with pytest.raises(DataError) as info:
        deadline(lambda: read_array_file(path, "evaluation data"), seconds=30)
    message = str(info.value)
    assert str(path) in message and "'x.npy'" in message
    assert "4,294,967,280 bytes" in message and "deflate" in message


def test_npz_total_over_the_budget_is_refused_naming_the_members(tmp_path: Path) -> None:
    path = tmp_path / "many.npz"
    np.savez(path, x=np.zeros(100, np.float32), y=np.zeros(100, np.int64))
    with pytest.raises(DataError) as info:
        read_array_file(path, "evaluation data", budget=1000)
    message = str(info.value)
    assert "'x.npy'" in message and "'y.npy'" in message and "budget of 1,000 bytes" in message


def test_npz_member_header_declaring_more_than_the_member_holds_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "liar.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", npy_header((10**6, 10**6)) + bytes(64))
    with pytest.raises(DataError) as info:
        deadline(lambda: read_array_file(path, "evaluation data"), seconds=30)
    message = str(info.value)
    assert "'x.npy'" in message and "shape (1000000, 1000000)" in message and "holds 64 bytes" in message


def test_genuine_npz_still_loads_member_by_member(tmp_path: Path) -> None:
    x = np.random.default_rng(0).normal(size=(50, 8)).astype(np.float32)
    y = np.arange(50) % 3
    np.savez_compressed(tmp_path / "d.npz", x=x, y=y)
    out = read_array_file(tmp_path / "d.npz", "data")
    assert np.array_equal(out["x"], x) and np.array_equal(out["y"], y)


def test_npz_member_with_a_flipped_byte_is_still_called_damaged(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.arange(1000, dtype=np.float32))
    data = bytearray(path.read_bytes())
    data[400] ^= 0xFF  # inside x.npy's array data (stored, not compressed)
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"not a valid NumPy \.npz file: found a damaged zip archive \(member 'x.npy'"):
        read_array_file(path, "data")


def test_zlib_is_deflate() -> None:  # the ratio check assumes deflate's ~1032:1 maximum
    assert len(zlib.compress(bytes(1 << 20), 9)) > (1 << 20) // 1100
