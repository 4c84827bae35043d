"""Train the digit classifier and write every file the dependability tests read.

Run from the project folder (``example_project/``)::

    python -m digits_demo.train            # same seed -> byte-identical files

Writes, relative to the project folder:

- ``models/digits_cnn.pt``  the trained state dict (``torch.load(..., weights_only=True)``)
- ``data/eval.npz``         ``x`` float32 ``(N, 1, 8, 8)`` in [0, 1], ``y`` int64 ``(N,)``: the test
                            split, each image rendered under one feasible scenario
- ``data/masks.npz``        ``masks`` bool ``(N, 8, 8)``: the digit's strokes in each evaluation image
                            (its scenario's rotation applied), for the occlusion gates
- ``data/scenarios.csv``    one row per ``eval.npz`` sample (same order), one column per condition
- ``data/conditions.toml``  each condition's full domain and the restriction
- ``data/operation.npz``    ``x`` (other digits under the operational mix of conditions) and their
                            labels ``y``: the profile ignores ``y``; the pmi gate uses it to label
                            its cells honestly and to check its bound against the observed error
- ``models/digits_cnn_0to7.pt``  a second reader trained on the digits 0-7 only, so that 8 and 9 are
                            classes it never saw (the runtime monitors' novel-class faults)
- ``data/monitor_fit.npz``  ``x``, ``y``: the training digits 0-7, each rendered under one training
                            scenario: the in-distribution data the runtime monitors are fitted on

The data is scikit-learn's bundled ``load_digits`` (1797 images, 8x8, 16 grey levels), split
stratified into train (55%), evaluation (30%) and operation (15%).
"""

from __future__ import annotations

import argparse
import csv
import io
import time
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn

from digits_demo.conditions import (
    CLEAN,
    DOMAINS,
    apply_conditions,
    object_masks,
    feasible_scenarios,
    write_conditions_toml,
)
from digits_demo.model import build_model

__all__ = ["main", "EVAL_HOLES", "KNOWN_DIGITS", "operational_weight"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SEED = 1234
#: The classes of the second reader (models/digits_cnn_0to7.pt); 8 and 9 are novel to it.
KNOWN_DIGITS = 8

#: Partial scenarios that never occur in the evaluation data: the known gaps of the (simulated)
#: recording campaign, each with its reason. They are feasible in operation, just untested.
EVAL_HOLES: tuple[tuple[dict[str, str], str], ...] = (
    ({"lighting": "night", "blur": "heavy"}, "night runs used the stabilised mount: no heavy motion blur at night"),
    ({"lighting": "bright", "blur": "heavy"}, "heavy blur came from rain on the lens, never recorded in bright sun"),
    ({"noise": "high", "rotation": "-15"}, "high-gain (noisy) runs were all on the level fixed mount: no roll"),
    ({"noise": "high", "rotation": "15"}, "high-gain (noisy) runs were all on the level fixed mount: no roll"),
)

# Operational profile: how often each value occurs in the field. Noise depends on lighting
# (the sensor gain rises as light falls), the other conditions are independent.
_P_LIGHTING = {"bright": 0.20, "normal": 0.45, "dim": 0.20, "night": 0.15}
_P_BLUR = {"none": 0.65, "light": 0.25, "heavy": 0.10}
_P_ROTATION = {"-15": 0.20, "0": 0.60, "15": 0.20}
_P_NOISE_GIVEN_LIGHTING = {
    "bright": {"none": 0.85, "low": 0.15, "high": 0.00},
    "normal": {"none": 0.75, "low": 0.25, "high": 0.00},
    "dim": {"none": 0.30, "low": 0.45, "high": 0.25},
    "night": {"none": 0.10, "low": 0.45, "high": 0.45},
}


def operational_weight(scenario: Mapping[str, str]) -> float:
    """Probability of a full scenario under the operational profile (0 for infeasible ones)."""
    return (
        _P_LIGHTING[scenario["lighting"]]
        * _P_BLUR[scenario["blur"]]
        * _P_ROTATION[scenario["rotation"]]
        * _P_NOISE_GIVEN_LIGHTING[scenario["lighting"]][scenario["noise"]]
    )


def _in_hole(scenario: Mapping[str, str]) -> bool:
    return any(all(scenario[k] == v for k, v in hole.items()) for hole, _ in EVAL_HOLES)


def _draw(rng: np.random.Generator, scenarios: Sequence[dict[str, str]], weights: Sequence[float], n: int):
    p = np.asarray(weights, dtype=np.float64)
    idx = rng.choice(len(scenarios), size=n, p=p / p.sum())
    return [scenarios[i] for i in idx]


def eval_scenarios(rng: np.random.Generator, n: int) -> list[dict[str, str]]:
    """One scenario per evaluation sample: every feasible scenario outside the holes at least
    once, the rest drawn from the operational profile restricted to those scenarios."""
    allowed = [s for s in feasible_scenarios() if not _in_hole(s)]
    if n < len(allowed):
        raise ValueError(f"need at least {len(allowed)} evaluation samples, got {n}")
    rest = _draw(rng, allowed, [operational_weight(s) for s in allowed], n - len(allowed))
    chosen = list(allowed) + rest
    order = rng.permutation(n)
    return [chosen[i] for i in order]


def operation_scenarios(rng: np.random.Generator, n: int) -> list[dict[str, str]]:
    """Scenarios drawn from the full operational profile (holes included)."""
    feasible = list(feasible_scenarios())
    return _draw(rng, feasible, [operational_weight(s) for s in feasible], n)


def training_scenarios(rng: np.random.Generator, n: int, p_clean: float = 0.25) -> list[dict[str, str]]:
    """Augmentation: clean with probability ``p_clean``, else uniform over feasible scenarios."""
    feasible = list(feasible_scenarios())
    picks = rng.integers(len(feasible), size=n)
    clean = rng.random(n) < p_clean
    return [dict(CLEAN) if c else feasible[i] for c, i in zip(clean, picks)]


def _write_npz(path: Path, **arrays: np.ndarray) -> None:
    """Like ``np.savez`` but byte-reproducible (fixed member timestamps)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, array in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def _write_scenarios_csv(path: Path, scenarios: Sequence[Mapping[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(list(DOMAINS))
        writer.writerows([s[name] for name in DOMAINS] for s in scenarios)


@torch.no_grad()
def _predict(model: nn.Module, x: Tensor, batch_size: int = 256) -> Tensor:
    model.eval()
    return torch.cat([model(x[i : i + batch_size]).argmax(1) for i in range(0, len(x), batch_size)])


def train(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    seed: int,
    epochs: int,
    batch_size: int = 64,
    lr: float = 5e-3,
) -> None:
    """Adam with a cosine schedule; each epoch re-renders the images under fresh scenarios."""
    rng = np.random.default_rng(seed)
    noise_gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    n = len(x)
    for _ in range(epochs):
        model.train()
        xa = apply_conditions(x, training_scenarios(rng, n), noise_gen)
        perm = torch.from_numpy(rng.permutation(n))
        for i in range(0, n, batch_size):
            idx = perm[i : i + batch_size]
            opt.zero_grad()
            F.cross_entropy(model(xa[idx]), y[idx]).backward()
            opt.step()
        sched.step()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m digits_demo.train", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed for everything (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=40, help="training epochs (default %(default)s)")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT, help="project folder to write models/ and data/ in")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]  # (1797, 1, 8, 8) in [0, 1]
    labels = digits.target.astype(np.int64)
    idx = np.arange(len(labels))
    idx_train, idx_rest = train_test_split(idx, test_size=0.45, stratify=labels, random_state=args.seed)
    idx_eval, idx_op = train_test_split(
        idx_rest, test_size=1 / 3, stratify=labels[idx_rest], random_state=args.seed
    )

    x_train, y_train = torch.from_numpy(images[idx_train]), torch.from_numpy(labels[idx_train])
    x_test, y_test = torch.from_numpy(images[idx_eval]), torch.from_numpy(labels[idx_eval])
    x_op, y_op = torch.from_numpy(images[idx_op]), torch.from_numpy(labels[idx_op])

    model = build_model()
    train(model, x_train, y_train, seed=args.seed, epochs=args.epochs)
    # The second reader never sees 8 or 9: they are novel classes for its runtime monitors.
    known = y_train < KNOWN_DIGITS
    model_0to7 = build_model(num_classes=KNOWN_DIGITS)
    train(model_0to7, x_train[known], y_train[known], seed=args.seed + 7, epochs=args.epochs)
    # What its monitors are fitted on: its own training digits, each under one training scenario.
    x_fit = apply_conditions(x_train[known], training_scenarios(np.random.default_rng(args.seed + 3),
                                                                int(known.sum())),
                             torch.Generator().manual_seed(args.seed + 3))

    # Evaluation data: the test split, each image under one scenario.
    rng = np.random.default_rng(args.seed + 1)
    scen_eval = eval_scenarios(rng, len(x_test))
    x_eval = apply_conditions(x_test, scen_eval, torch.Generator().manual_seed(args.seed + 1))
    # Operational data: the other held-out digits under the operational profile.
    scen_op = operation_scenarios(rng, len(x_op))
    x_operation = apply_conditions(x_op, scen_op, torch.Generator().manual_seed(args.seed + 2))

    out: Path = args.out
    (out / "models").mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "models" / "digits_cnn.pt")
    torch.save(model_0to7.state_dict(), out / "models" / "digits_cnn_0to7.pt")
    _write_npz(out / "data" / "monitor_fit.npz", x=x_fit.numpy(), y=y_train[known].numpy())
    _write_npz(out / "data" / "eval.npz", x=x_eval.numpy(), y=y_test.numpy())
    _write_npz(out / "data" / "masks.npz", masks=object_masks(x_test, scen_eval).numpy())
    _write_scenarios_csv(out / "data" / "scenarios.csv", scen_eval)
    write_conditions_toml(out / "data" / "conditions.toml")
    _write_npz(out / "data" / "operation.npz", x=x_operation.numpy(), y=y_op.numpy())
    elapsed = time.perf_counter() - start

    clean_acc = (_predict(model, x_test) == y_test).float().mean().item()
    hit = _predict(model, x_eval) == y_test
    print(f"train/eval/operation samples: {len(x_train)}/{len(x_test)}/{len(x_op)}")
    print(f"clean test accuracy:       {clean_acc:.4f}")
    print(f"conditioned eval accuracy: {hit.float().mean().item():.4f}")
    for value in DOMAINS["lighting"]:
        mask = torch.tensor([s["lighting"] == value for s in scen_eval])
        print(f"  lighting={value:<7} {hit[mask].float().mean().item():.4f}  (n={int(mask.sum())})")
    for value in DOMAINS["noise"]:
        mask = torch.tensor([s["noise"] == value for s in scen_eval])
        print(f"  noise={value:<10} {hit[mask].float().mean().item():.4f}  (n={int(mask.sum())})")
    seen = y_test < KNOWN_DIGITS
    acc_0to7 = (_predict(model_0to7, x_eval[seen]) == y_test[seen]).float().mean().item()
    print(f"0-7 reader, conditioned eval accuracy on 0-7: {acc_0to7:.4f} (n={int(seen.sum())})")
    print(f"wrote models/ and data/ under {out} in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
