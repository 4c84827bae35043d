"""Settings resolution (marker > CLI > env > ini > default), parsing errors, paths, factory specs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_dnnsafety.settings import FACTORY_RE, MAX_SEED, SETTINGS, Resolved, Settings
from pytest_dnnsafety.errors import ConfigError, DnnSafetyError

MARKER = "min_scene_coverage"


def make_settings(
    root: Path,
    *,
    cli: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    ini: dict[str, Any] | None = None,
) -> Settings:
    """Settings from short names (``seed=...``) spelled the way each source spells them.

    The ini file lives in ``root/project``, pytest is invoked from ``root/invoked``, so the two
    folders that relative paths resolve against differ.
    """
    cli_values = {SETTINGS[name].dest: value for name, value in (cli or {}).items()}
    env_values = {SETTINGS[name].env: value for name, value in (env or {}).items()}
    ini_values = {SETTINGS[name].ini: value for name, value in (ini or {}).items()}
    return Settings(
        cli=cli_values,
        ini=ini_values.get,
        env=env_values,
        ini_file=root / "project" / "pyproject.toml",
        invocation_dir=root / "invoked",
    )


def ini_source(root: Path, name: str) -> str:
    return f"ini option dnnsafety_{name} in {root / 'project' / 'pyproject.toml'}"


def config_error(settings: Settings, name: str) -> str:
    """The message of the ConfigError that resolving ``name`` raises."""
    with pytest.raises(ConfigError) as info:
        settings.get(name)
    return str(info.value)


# ------------------------------------------------------------------------------------- spellings


def test_each_setting_has_four_derived_spellings() -> None:
    setting = SETTINGS["batch_size"]
    assert (setting.ini, setting.cli, setting.env, setting.dest) == (
        "dnnsafety_batch_size", "--dnnsafety-batch-size", "DNNSAFETY_BATCH_SIZE", "dnnsafety_batch_size")


def test_literal_spellings_are_read_from_each_source(tmp_path: Path) -> None:
    def build(**sources: Any) -> Settings:
        return Settings(cli=sources.get("cli", {}), ini=sources.get("ini", {}).get, env=sources.get("env", {}),
                        ini_file=tmp_path / "pyproject.toml", invocation_dir=tmp_path)

    assert build(cli={"dnnsafety_batch_size": "7"}).value("batch_size") == 7
    assert build(env={"DNNSAFETY_BATCH_SIZE": "8"}).value("batch_size") == 8
    assert build(ini={"dnnsafety_batch_size": "9"}).value("batch_size") == 9


def test_cli_may_be_a_callable_like_config_getoption(tmp_path: Path) -> None:
    settings = Settings(cli=lambda dest: "3" if dest == "dnnsafety_seed" else None, ini=lambda name: None,
                        env={}, ini_file=None, invocation_dir=tmp_path)
    assert settings.get("seed").value == 3
    assert settings.get("batch_size").source == "default"


def test_without_an_ini_file_the_ini_source_names_only_the_option(tmp_path: Path) -> None:
    settings = Settings(cli={}, ini={"dnnsafety_seed": "4"}.get, env={}, ini_file=None, invocation_dir=tmp_path)
    assert settings.get("seed").source == "ini option dnnsafety_seed"
    assert settings.ini_dir == tmp_path


# ------------------------------------------------------------------------------------ precedence

# (setting, value per source, expected parsed value per source)
PRECEDENCE = [
    pytest.param("seed", {"marker": "5", "cli": "4", "env": "3", "ini": "2"}, {"marker": 5, "cli": 4, "env": 3,
                 "ini": 2, "default": 0}, id="seed"),
    pytest.param("batch_size", {"marker": 64, "cli": "32", "env": "16", "ini": "8"}, {"marker": 64, "cli": 32,
                 "env": 16, "ini": 8, "default": 256}, id="batch_size"),
    pytest.param("device", {"marker": "cuda:1", "cli": "CPU", "env": "mps", "ini": "cuda"}, {"marker": "cuda:1",
                 "cli": "cpu", "env": "mps", "ini": "cuda", "default": "auto"}, id="device"),
    pytest.param("data", {"marker": "m.npz", "cli": "c.npz", "env": "e.npz", "ini": "i.npz"}, {"marker": "m.npz",
                 "cli": "c.npz", "env": "e.npz", "ini": "i.npz", "default": None}, id="data"),
]


def expected_source(root: Path, name: str, level: str) -> str:
    return {
        "marker": f"marker @pytest.mark.{MARKER}({name}=...)",
        "cli": f"command-line option {SETTINGS[name].cli}",
        "env": f"environment variable {SETTINGS[name].env}",
        "ini": ini_source(root, name),
        "default": "default",
    }[level]


@pytest.mark.parametrize(("name", "raw", "parsed"), PRECEDENCE)
@pytest.mark.parametrize("level", ["marker", "cli", "env", "ini", "default"])
def test_highest_given_source_wins(tmp_path: Path, name: str, raw: dict, parsed: dict, level: str) -> None:
    """With every source below ``level`` also set, ``level`` still wins."""
    order = ["marker", "cli", "env", "ini", "default"]
    given_levels = order[order.index(level):]
    settings = make_settings(tmp_path, **{lvl: {name: raw[lvl]} for lvl in given_levels if lvl in ("cli", "env", "ini")})
    if "marker" in given_levels:
        resolved = settings.get(name, raw["marker"], marker=MARKER)
    else:
        resolved = settings.get(name)
    assert resolved.value == parsed[level]
    assert resolved.source == expected_source(tmp_path, name, level)


def test_marker_without_a_marker_name_is_called_a_marker_keyword(tmp_path: Path) -> None:
    assert make_settings(tmp_path).get("seed", 9).source == "marker keyword"


def test_marker_value_does_not_replace_the_cached_value(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, ini={"seed": "2"})
    assert settings.get("seed", 7, marker=MARKER).value == 7
    assert settings.value("seed") == 2


def test_cli_false_still_beats_ini_true(tmp_path: Path) -> None:
    resolved = make_settings(tmp_path, cli={"allow_pickle": False}, ini={"allow_pickle": "true"}).get("allow_pickle")
    assert resolved.value is False and resolved.source == "command-line option --dnnsafety-allow-pickle"


@pytest.mark.parametrize("unset", [None, "", []])
def test_empty_ini_values_count_as_unset(tmp_path: Path, unset: Any) -> None:
    resolved = make_settings(tmp_path, ini={"batch_size": unset}).get("batch_size")
    assert (resolved.value, resolved.source) == (256, "default")


@pytest.mark.parametrize(("raw", "value"), [("true", True), ("ON", True), ("1", True), ("yes", True),
                                            ("false", False), ("Off", False), ("0", False), ("no", False)])
def test_bool_spellings(tmp_path: Path, raw: str, value: bool) -> None:
    assert make_settings(tmp_path, env={"junit_properties": raw}).value("junit_properties") is value


def test_validate_all_accepts_the_defaults(tmp_path: Path) -> None:
    make_settings(tmp_path).validate_all()


def test_validate_all_stops_on_the_first_bad_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dnnsafety_device='gpu'"):
        make_settings(tmp_path, env={"device": "gpu"}).validate_all()


# ------------------------------------------------------------------------------------ bad values


def test_config_error_is_part_of_the_error_family() -> None:
    assert issubclass(ConfigError, DnnSafetyError) and issubclass(ConfigError, ValueError)


def test_seed_not_an_integer_from_ini_names_the_ini_file(tmp_path: Path) -> None:
    message = config_error(make_settings(tmp_path, ini={"seed": "abc"}), "seed")
    assert "dnnsafety_seed='abc'" in message
    assert ini_source(tmp_path, "seed") in message
    assert "expected an integer" in message
    assert "Fix: use a non-negative integer" in message


def test_seed_negative_from_cli_names_the_flag(tmp_path: Path) -> None:
    message = config_error(make_settings(tmp_path, cli={"seed": -1}), "seed")
    assert "dnnsafety_seed=-1" in message
    assert "command-line option --dnnsafety-seed" in message
    assert "must be >= 0" in message
    assert "Fix: use a non-negative integer" in message


def test_seed_boolean_from_marker_is_not_an_integer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dnnsafety_seed=True \(from marker @pytest.mark.min_scene_coverage"):
        make_settings(tmp_path).get("seed", True, marker=MARKER)


def test_seed_float_from_marker_is_not_an_integer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected an integer"):
        make_settings(tmp_path).get("seed", 1.5, marker=MARKER)


def test_largest_seed_is_accepted(tmp_path: Path) -> None:
    assert MAX_SEED == 2**63 - 1
    assert make_settings(tmp_path, ini={"seed": str(MAX_SEED)}).value("seed") == MAX_SEED


def test_seed_beyond_64_bits_from_ini_is_refused_at_start(tmp_path: Path) -> None:
    message = config_error(make_settings(tmp_path, ini={"seed": "100000000000000000000000"}), "seed")
    first = message.splitlines()[0]
    assert first.startswith("dnnsafety_seed='100000000000000000000000'")
    assert ini_source(tmp_path, "seed") in first
    assert "must be <= 9223372036854775807 (2**63-1" in first
    assert "Fix: use a non-negative integer below 2**63" in first


@pytest.mark.parametrize("seed", [10**23, MAX_SEED + 1], ids=["10**23", "2**63"])
def test_seed_beyond_64_bits_as_marker_int_names_the_marker(tmp_path: Path, seed: int) -> None:
    with pytest.raises(ConfigError, match=rf"^dnnsafety_seed={seed} \(from marker @pytest.mark.{MARKER}\(seed=\.\.\.\)\): "
                                          r"must be <= 9223372036854775807"):
        make_settings(tmp_path).get("seed", seed, marker=MARKER)


@pytest.mark.parametrize("level", ["cli", "env"])
def test_seed_beyond_64_bits_names_cli_and_env_sources(tmp_path: Path, level: str) -> None:
    message = config_error(make_settings(tmp_path, **{level: {"seed": str(2**64)}}), "seed")
    assert (SETTINGS["seed"].cli if level == "cli" else SETTINGS["seed"].env) in message
    assert "must be <= 9223372036854775807" in message


def test_batch_size_has_no_upper_bound(tmp_path: Path) -> None:
    assert make_settings(tmp_path, ini={"batch_size": str(2**70)}).value("batch_size") == 2**70


def test_batch_size_zero_from_env_names_the_variable(tmp_path: Path) -> None:
    message = config_error(make_settings(tmp_path, env={"batch_size": "0"}), "batch_size")
    assert "dnnsafety_batch_size='0'" in message
    assert "environment variable DNNSAFETY_BATCH_SIZE" in message
    assert "must be >= 1" in message
    assert "Fix: use a positive integer" in message


def test_device_gpu_lists_the_valid_devices(tmp_path: Path) -> None:
    message = config_error(make_settings(tmp_path, cli={"device": "gpu"}), "device")
    assert "dnnsafety_device='gpu'" in message
    assert "command-line option --dnnsafety-device" in message
    assert "Fix: use one of auto, cpu, cuda, cuda:N, mps" in message


@pytest.mark.parametrize("raw", ["cuda:", "cuda:x", "cuda1", "tpu", " "])
def test_device_malformed_is_refused(tmp_path: Path, raw: str) -> None:
    with pytest.raises(ConfigError, match="dnnsafety_device="):
        make_settings(tmp_path, cli={"device": raw}).get("device")


def test_empty_environment_variable_counts_as_unset(tmp_path: Path) -> None:
    resolved = make_settings(tmp_path, env={"device": ""}).get("device")
    assert (resolved.value, resolved.source) == ("auto", "default")


def test_bool_maybe_from_ini_names_true_or_false(tmp_path: Path) -> None:
    message = config_error(make_settings(tmp_path, ini={"allow_pickle": "maybe"}), "allow_pickle")
    assert "dnnsafety_allow_pickle='maybe'" in message
    assert ini_source(tmp_path, "allow_pickle") in message
    assert "expected true or false" in message
    assert "Fix: use true only for model files you trust" in message


@pytest.mark.parametrize("raw", ["", "   "])
def test_path_empty_from_cli_is_refused(tmp_path: Path, raw: str) -> None:
    message = config_error(make_settings(tmp_path, cli={"json": raw}), "json")
    assert f"dnnsafety_json={raw!r}" in message
    assert "command-line option --dnnsafety-json" in message
    assert "expected a non-empty path" in message
    assert "Fix: give a writable file path" in message


def test_path_not_a_string_from_marker_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dnnsafety_data=42 \(from marker"):
        make_settings(tmp_path).get("data", 42, marker=MARKER)


def test_bad_value_is_not_cached_as_good(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, env={"seed": "x"})
    config_error(settings, "seed")
    config_error(settings, "seed")


# ------------------------------------------------------------------------------------------ paths


def test_ini_relative_path_resolves_against_the_ini_folder(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, ini={"data": "data/eval.npz"})
    assert settings.path(settings.get("data")) == tmp_path / "project" / "data" / "eval.npz"


@pytest.mark.parametrize("level", ["cli", "env"])
def test_cli_and_env_relative_paths_resolve_against_the_invocation_folder(tmp_path: Path, level: str) -> None:
    settings = make_settings(tmp_path, **{level: {"data": "data/eval.npz"}})
    assert settings.path(settings.get("data")) == tmp_path / "invoked" / "data" / "eval.npz"


def test_marker_relative_path_resolves_against_the_ini_folder(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    assert settings.path(settings.get("data", "night.npz", marker=MARKER)) == tmp_path / "project" / "night.npz"


def test_absolute_path_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere" / "eval.npz"
    settings = make_settings(tmp_path, cli={"data": str(target)})
    assert settings.path(settings.get("data")) == target


def test_path_surrounding_whitespace_is_stripped(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, ini={"data": "  eval.npz "})
    assert settings.path(settings.get("data")) == tmp_path / "project" / "eval.npz"


def test_home_relative_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    settings = make_settings(tmp_path, ini={"data": "~/eval.npz"})
    assert settings.path(settings.get("data")) == tmp_path / "home" / "eval.npz"


@pytest.mark.parametrize(("name", "fixture"), [("model", "model"), ("data", "dataset"),
                                               ("scenarios", "scenario_table")])
def test_require_unset_names_every_way_to_set_it(tmp_path: Path, name: str, fixture: str) -> None:
    setting = SETTINGS[name]
    with pytest.raises(ConfigError) as info:
        make_settings(tmp_path).require(name, f"the {name}")
    message = str(info.value)
    assert message.startswith(f"the {name} is not configured")
    for spelling in (setting.ini, setting.cli, setting.env, f"`{fixture}` fixture"):
        assert spelling in message


def test_require_set_returns_the_resolved_value(tmp_path: Path) -> None:
    resolved = make_settings(tmp_path, env={"model": "m.pt2"}).require("model", "the model")
    assert (resolved.value, resolved.source) == ("m.pt2", "environment variable DNNSAFETY_MODEL")


# -------------------------------------------------------------------------------------- factories


@pytest.mark.parametrize("spec", ["pkg.mod:fn", "mymod:build", "a_b.c1:Outer.method", "_private:_f"])
def test_factory_specs_are_factories(spec: str) -> None:
    assert FACTORY_RE.match(spec)
    assert Resolved("model", spec, "default").is_factory


@pytest.mark.parametrize("spec", [
    "models/x.pt", "x.pt2", "C:/x.pt", "C:\\models\\x.pt", "c:/Users/me/m.pt2", "./pkg:fn", "pkg.mod:",
    ":fn", "pkg mod:fn", "pkg.mod:fn()", "1pkg:fn", "pkg:fn:extra", "pkg/mod:fn",
])
def test_paths_and_malformed_specs_are_not_factories(spec: str) -> None:
    assert not FACTORY_RE.match(spec)
    assert not Resolved("model", spec, "default").is_factory


def test_non_string_value_is_not_a_factory() -> None:
    assert not Resolved("model", None, "default").is_factory
    assert not Resolved("seed", 3, "default").is_factory


# ---------------------------------------------------------------------------------------- property


@given(seed=st.integers(min_value=0, max_value=MAX_SEED), level=st.sampled_from(["marker", "cli", "env", "ini"]),
       pad=st.sampled_from(["", " ", "\t"]))
def test_any_seed_in_range_round_trips(seed: int, level: str, pad: str) -> None:
    raw = f"{pad}{seed}{pad}"
    settings = make_settings(Path("/nonexistent"), **({} if level == "marker" else {level: {"seed": raw}}))
    resolved = settings.get("seed", raw, marker=MARKER) if level == "marker" else settings.get("seed")
    assert resolved.value == seed
    assert resolved.raw == raw
