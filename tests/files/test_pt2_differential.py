"""Planted ``.pt2`` files of issue #29 §3: a zip parser differential, and shape arithmetic that hangs.

The differential: a file with two central directories. Python's :mod:`zipfile` (which the static
check reads with) reads the clean one, directly before the end record; torch's reader
(``torch.export.load`` → ``PyTorchFileReader``, miniz) reads the one the end record names, whose
program JSON holds ``__import__('os').system(...)`` in an ``expr_str``. The check must look at the
bytes torch reads, and the plugin must load the very bytes it checked.

The hangs: ``expr_str: "10**10**10"`` is plain arithmetic that ``sympy.sympify`` computes for
hours while ``torch.export.load`` runs; a guard ``math.factorial(10**9) > 0`` runs on every
forward pass. Both are refused before sympy or the guard sees them, within a time limit.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _hostile import WithConstant, genuine, make_settings, save_export  # noqa: F401 (fixture)
from test_hostile_export import Archive, Members, program_expr, write_zip

from pytest_dnnsafety.errors import ModelLoadError
from pytest_dnnsafety.files import pt2_archive
from pytest_dnnsafety.files.loading import load_model

CPU = torch.device("cpu")
REFUSED = "refused to load model.pt2"




# ------------------------------------------------------------------------------ zip records by hand


def local(name: str, data: bytes, flags: int = 0, name_in_header: str | None = None) -> bytes:
    raw = (name_in_header or name).encode()
    return struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, flags, 0, 0, 0, zlib.crc32(data), len(data), len(data),
                       len(raw), 0) + raw + data


def central(name: str, data: bytes, offset: int, flags: int = 0) -> bytes:
    raw = name.encode()
    return struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, flags, 0, 0, 0, zlib.crc32(data), len(data), len(data),
                       len(raw), 0, 0, 0, 0, 0, offset) + raw


def end_record(count: int, size: int, offset: int, comment: bytes = b"") -> bytes:
    return struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, size, offset, len(comment)) + comment


def plain_zip(members: Members, prefix: bytes = b"", gap: bytes = b"", comment: bytes = b"",
              header_names: dict[str, str] | None = None) -> bytes:
    """A stored zip; ``prefix`` before the first member, ``gap`` after the first member's data."""
    out = bytearray(prefix)
    offsets = []
    for index, (name, data) in enumerate(members):
        offsets.append(len(out))
        out += local(name, data, name_in_header=(header_names or {}).get(name))
        if index == 0:
            out += gap
    directory = b"".join(central(name, data, offset) for (name, data), offset in zip(members, offsets))
    start = len(out)
    return bytes(out + directory + end_record(len(members), len(directory), start, comment))


def two_directories(clean: Members, evil: Members) -> bytes:
    """Evil members, clean members, the evil central directory, the clean one, an end record naming the evil one.

    Python's zipfile reads the central directory directly before the end record and shifts every
    offset by the distance to where the end record says it is; the clean directory's offsets are
    written shifted back, so Python reads the clean members. torch's reader reads the directory at
    the offset the end record names.
    """
    out = bytearray()
    evil_at = []
    for name, data in evil:
        evil_at.append(len(out))
        out += local(name, data)
    clean_at = []
    for name, data in clean:
        clean_at.append(len(out))
        out += local(name, data)
    evil_directory = b"".join(central(name, data, at) for (name, data), at in zip(evil, evil_at))
    shift = len(evil_directory)
    clean_directory = b"".join(central(name, data, at - shift) for (name, data), at in zip(clean, clean_at))
    assert len(clean_directory) == len(evil_directory)
    start = len(out)
    return bytes(out + evil_directory + clean_directory + end_record(len(clean), len(evil_directory), start))


def evil_members(genuine: Members, marker: Path) -> Members:
    archive = Archive(genuine)
    program_expr(archive, marker)
    return archive.members


def load(root: Path) -> torch.nn.Module:
    return load_model(make_settings(root, model="model.pt2"), CPU)


# ---------------------------------------------------------------------------------- the differential


def test_two_central_directories_are_refused_and_run_nothing(genuine: Members, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    data = two_directories(genuine, evil_members(genuine, marker))
    with zipfile.ZipFile(io.BytesIO(data)) as archive:  # Python's view: the genuine program
        assert archive.read(genuine[0][0]) == genuine[0][1]
        assert [info.filename for info in archive.infolist()] == [name for name, _ in genuine]
    (tmp_path / "model.pt2").write_bytes(data)
    with pytest.raises(ModelLoadError) as info:
        load(tmp_path)
    assert not marker.exists(), "the planted expr_str ran"
    line = str(info.value).splitlines()[0]
    assert REFUSED in line and "a second central directory" in line, line
    assert "torch would read members Python's zipfile does not see" in line
    assert "Fix:" in line


def test_two_central_directories_are_live(genuine: Members, tmp_path: Path) -> None:
    """The control: torch alone reads the evil directory and runs its expr_str."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "model.pt2"
    path.write_bytes(two_directories(genuine, evil_members(genuine, marker)))
    try:
        torch.export.load(str(path))
    except Exception:  # noqa: BLE001, S110 - the payload runs before torch notices anything wrong
        pass
    assert marker.exists()


def _comment_with_end(members: Members) -> bytes:
    data = plain_zip(members)
    return data[:-2] + struct.pack("<H", 22) + end_record(0, 0, 0)


def _zip64_elsewhere(members: Members) -> bytes:
    """A zip64 locator naming a decoy zip64 end record (no members) at the file's start.

    Python's zipfile reads the zip64 record directly before the locator (the genuine one), torch's
    reader the one the locator names.
    """
    decoy = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 0, 0, 0, 0)
    data = plain_zip(members, prefix=decoy)
    end = data[-22:]
    size, offset = struct.unpack_from("<2L", end, 12)
    record = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, len(members), len(members), size, offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, 0, 1)
    return data[:-22] + record + locator + end


LAYOUTS: dict[str, tuple[Callable[[Members], bytes], str]] = {
    "data_before_first_member": (lambda m: plain_zip(m, prefix=b"\0" * 64), "data before the first member"),
    "data_between_members": (lambda m: plain_zip(m, gap=local("hidden", b"x")), "between members"),
    "comment_with_an_end_record": (_comment_with_end, "followed by a comment"),
    "zip64_locator_elsewhere": (_zip64_elsewhere, "a zip64 locator naming a zip64 end record at offset 0"),
    "local_name_differs": (lambda m: plain_zip(m, header_names={m[3][0]: m[3][0].upper()}), "whose local header names"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_odd_zip_layouts_are_refused_naming_why(genuine: Members, tmp_path: Path, layout: str) -> None:
    build, fragment = LAYOUTS[layout]
    (tmp_path / "model.pt2").write_bytes(build(genuine))
    with pytest.raises(ModelLoadError) as info:
        load(tmp_path)
    line = str(info.value).splitlines()[0]
    assert "model.pt2" in line and fragment in line and "Fix:" in line, line


def test_duplicate_member_names_are_refused_even_when_both_are_clean(genuine: Members, tmp_path: Path) -> None:
    archive = Archive(genuine)
    archive.add("data/constants/tensor_0", archive.get("data/constants/tensor_0"))
    write_zip(tmp_path / "model.pt2", archive.members)
    with pytest.raises(ModelLoadError, match=r"refused to load model\.pt2: it holds two members named "
                                             r"'[^']*/data/constants/tensor_0'"):
        load(tmp_path)


def test_genuine_layouts_are_admitted(genuine: Members, tmp_path: Path) -> None:
    """torch.export.save's own layout (data descriptors, zip64 records) and zipfile's, stored or deflated."""
    from pytest_dnnsafety.files.pt2_zip import ZipLayoutError, zip_entries

    path = tmp_path / "saved.pt2"
    torch.export.save(torch.export.export(WithConstant().eval(), (torch.zeros(2, 2, 2),)), str(path))
    assert len(zip_entries(path.read_bytes())) > 5
    for compression in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
            for name, data in genuine:
                archive.writestr(name, data)
        assert len(zip_entries(buffer.getvalue())) == len(genuine)
    with pytest.raises(ZipLayoutError, match="second central directory"):
        zip_entries(two_directories(genuine, genuine))


def test_the_checked_bytes_are_the_loaded_bytes(genuine: Members, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A file replaced between the check and the load: the load still reads what was checked."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "model.pt2"
    write_zip(path, genuine)
    evil = Archive(genuine)
    program_expr(evil, marker)
    check = pt2_archive.check_export_archive

    def check_then_swap(*args: object) -> None:
        check(*args)  # type: ignore[arg-type]
        write_zip(path, evil.members)

    monkeypatch.setattr(pt2_archive, "check_export_archive", check_then_swap)
    model = load(tmp_path)
    assert not marker.exists()
    assert model(torch.zeros(2, 2, 2)).shape == (2, 3)


def test_the_clean_export_still_loads(genuine: Members, tmp_path: Path) -> None:
    write_zip(tmp_path / "model.pt2", genuine)
    assert load(tmp_path)(torch.zeros(2, 2, 2)).shape == (2, 3)


# ------------------------------------------------------------------------------------- the hangs


def _with_expr(expr: str) -> Callable[[Archive], None]:
    def build(archive: Archive) -> None:
        program = archive.program()
        meta = program["graph_module"]["graph"]["tensor_values"]["x"]
        meta["sizes"][0] = {"as_expr": {"expr_str": expr, "hint": {"as_int": 2}}}
        archive.set_program(program)
    return build


def _with_guard(guard: str) -> Callable[[Archive], None]:
    def build(archive: Archive) -> None:
        program = archive.program()
        program["guards_code"] = [*program.get("guards_code", []), guard]
        archive.set_program(program)
    return build


def _pow_node(archive: Archive) -> None:
    """A graph node ``pw = 10 ** 1000000000``, unused: the model computes it on every forward pass."""
    program = archive.program()
    graph = program["graph_module"]["graph"]
    graph["nodes"].insert(0, {
        "target": "_operator.pow", "name": "pw", "metadata": {}, "is_hop_single_tensor_return": None,
        "inputs": [{"name": "a", "arg": {"as_int": 10}, "kind": 1}, {"name": "b", "arg": {"as_int": 10**9}, "kind": 1}],
        "outputs": [{"as_sym_int": {"as_name": "pw"}}]})
    graph.setdefault("sym_int_values", {})["pw"] = {"as_int": 5}
    archive.set_program(program)


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory: pytest.TempPathFactory) -> Members:
    """A dynamic-batch export (batch 2..64): its program carries symbolic sizes."""
    path = tmp_path_factory.mktemp("dynamic") / "dynamic.pt2"
    batch = torch.export.Dim("batch", min=2, max=64)
    program = torch.export.export(WithConstant().eval(), (torch.zeros(4, 2, 2),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(path))
    with zipfile.ZipFile(path) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


HANGS: dict[str, tuple[Callable[[Archive], None], str]] = {
    "expr_10_pow_10_pow_10": (_with_expr("10**10**10"), "expr_str '10**10**10'"),
    "expr_2_pow_10_pow_10": (_with_expr("2**10**10"), "expr_str '2**10**10'"),
    "expr_srepr_pow": (_with_expr("Pow(Integer(10), Pow(Integer(10), Integer(10)))"), "expr_str 'Pow(Integer(10)"),
    "expr_shift": (_with_expr("LShift(Integer(1), Integer(10000000000))"), "expr_str 'LShift"),
    "guard_factorial": (_with_guard("math.factorial(10**9) > 0"), "guards_code entry 'math.factorial(10**9) > 0'"),
    "guard_power_of_a_size": (_with_guard("L['x'].size()[0] ** 10**9 > 0"), "guards_code entry"),
    "node_power": (_pow_node, "a node 'pw' (_operator.pow) whose exponent 1000000000"),
}


@pytest.mark.slow
def test_hanging_shape_arithmetic_is_refused_within_a_time_limit(genuine: Members, dynamic: Members,
                                                                 tmp_path: Path) -> None:
    """Every planted file loaded (and, if it loads, called once) in one subprocess, killed after 60 s."""
    cases = {}
    for name, (build, _) in HANGS.items():
        archive = Archive(dynamic if name.startswith("guard") else genuine)
        build(archive)
        root = tmp_path / name
        root.mkdir()
        write_zip(root / "model.pt2", archive.members)
        cases[name] = str(root)
    script = textwrap.dedent("""
        import json, sys
        from pathlib import Path
        import torch
        sys.path[:0] = json.loads(sys.argv[2])
        from _hostile import make_settings
        from pytest_dnnsafety.files.loading import load_model
        results = {}
        for name, root in json.loads(sys.argv[1]).items():
            try:
                model = load_model(make_settings(Path(root), model="model.pt2"), torch.device("cpu"))
                model(torch.zeros(4, 2, 2))
                results[name] = "loaded"
            except Exception as exc:
                results[name] = str(exc).splitlines()[0]
        print(json.dumps(results))
    """)
    tests = str(Path(__file__).parents[1])
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases), json.dumps([tests])],
                          capture_output=True, text=True, timeout=60, check=True)
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (_, fragment) in HANGS.items():
        assert REFUSED in results[name] and "models/model.json" in results[name], (name, results[name])
        assert fragment in results[name], (name, results[name])


def test_dynamic_export_still_loads(dynamic: Members, tmp_path: Path) -> None:
    write_zip(tmp_path / "model.pt2", dynamic)
    model = load(tmp_path)
    assert model(torch.zeros(5, 2, 2)).shape == (5, 3)


@pytest.mark.parametrize("text", ["10**10**10", "2**s0", "Float('1e100000')", "Max(" + ", ".join(
    f"s{i}" for i in range(65)) + ")", "-" * 150 + "1"], ids=["power-tower", "symbolic-exponent", "huge-float",
                                                            "max-of-65", "nested-150"])
def test_expression_bound_names_the_limit(text: str) -> None:
    from pytest_dnnsafety.files.pt2_program import program_problem

    problem = program_problem({"x": {"expr_str": text}})
    assert problem is not None and "expr_str" in problem, problem
    assert "sympy.sympify would compute it" in problem or "not a plain shape expression" in problem


def test_shape_expressions_torch_writes_pass() -> None:
    from pytest_dnnsafety.files.pt2_program import program_problem

    for text in ("Symbol('s77', positive=True, integer=True)",
                 "Mul(Integer(3), Symbol('s77', positive=True, integer=True))", "Pow(Symbol('s0'), Integer(2))", "Pow(s0, Rational(1, 2))", "-int_oo",
                 "FloorDiv(Add(s0, Integer(-1)), Integer(2))", "Max(1, s0)"):
        assert program_problem({"x": {"expr_str": text}}) is None, text
    for guard in ("L['x'].size()[0] <= 1024", "(L['x'].size()[0]) % 2 == 0", "(-1 << 63) < L['x'].size()[0]",
                  "math.floor(L['x'].size()[0] / 2) == 3", "torch.sym_float(L['x'].size()[0]) ** 0.5 > 1"):
        assert program_problem({"guards_code": [guard]}) is None, guard
