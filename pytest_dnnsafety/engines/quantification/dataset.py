"""DeepQuant over a data set: :func:`quantify_safety` and its summary :class:`SafetyQuantification`.

The gated per-input radius is the ``statistic``: ``"certified"`` (the default) — the radius
CROWN/IBP *prove* (:func:`.certified.certified_radius`); ``"estimate"`` — DeepQuant's
``d' = s(x)/Q`` (Theorem 1) with ``Q`` a *lower* bound found by search, a heuristic that may
overstate the safe radius (it is a guarantee only if the optimisation is proven global, which a
pattern search is not). Every input's estimate, and its gated radius, are checked against the
nearest adversarial example found — PGD on ``s`` (:func:`.gradients.pgd_nearest_unsafe`) with
the gate's budget (``iterations`` steps, ``starts`` restarts) inside the ball of each claimed
radius, and the points the searches evaluated: an input with ``s < 0`` inside its gated radius is
a contradiction (the gate fails and names the input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.engines.core.runner import Batch, Runner
from pytest_dnnsafety.engines.quantification.certified import certified_radius
from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.engines.quantification.common import lp_norm
from pytest_dnnsafety.engines.quantification.engine import WORST_COLUMNS, SafeRadiusEngine
from pytest_dnnsafety.engines.quantification.gradients import pgd_nearest_unsafe
from pytest_dnnsafety.engines.quantification.options import (Certification, GatedRadius, SafetyProperty, SearchBudget,
                                                             SearchPlan)
from pytest_dnnsafety.engines.quantification.scale import gradient_search, resolve_search
from pytest_dnnsafety.engines.quantification.search import lipschitz_search

__all__ = ["SafetyQuantification", "quantify_safety"]

#: How each statistic is named in every output.
STATISTIC_LABELS = {"estimate": "estimate (heuristic lower bound on Q ⇒ not a guarantee)",
                    "gradient": "estimate (minimum-norm attack: an upper bound on the minimal adversarial radius, not "
                                "a guarantee)",
                    "certified": "estimate (not run: search='certified')"}
#: The PGD check runs inside this fraction of a claimed radius, so that a point it finds lies inside the ball
#: whatever the rounding of x ± r.
_INSIDE = 1 - 1e-5
#: How many offending inputs the messages name.
_NAMED = 5
#: Why the PGD check was given up.
_NO_GRADIENT = "the model gives no input gradient"


#: What the estimate is, per search (in the details).
_ESTIMATE_NOTES = {
    "coordinate": "d' = s(x)/Q with Q a lower bound found by search: a heuristic that may overstate the true safe "
                  "radius (a guarantee only if the optimisation were proven global)",
    "gradient": "the distance of the nearest adversarial example (s < 0) a minimum-norm attack found: an upper bound "
                "on the true minimal adversarial radius where one was found (d where none was: then nothing is "
                "shown); not a guarantee of safety",
    "certified": "not run (search='certified'): only the certified radius, a sound lower bound",
}


def _quantile(values: Tensor, q: float) -> float:
    """The lower empirical ``q``-quantile (``q = 0``: the minimum) of the values that are not NaN."""
    v = values[~torch.isnan(values)].sort().values
    if v.numel() == 0:
        return math.nan
    return float(v[math.floor(q * (v.numel() - 1))])


def _num(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _closer(unsafe: Tensor, radius: Tensor, applicable: Tensor, strict: bool) -> Tensor:
    """Inputs with a point of ``s < 0`` inside their claimed (closed) ball of ``radius`` > 0.

    ``strict`` (the certified radius): only points clearly inside, ``< r·(1 − 1e-6)``, so that the rounding of
    ``x ± r`` is never taken for a contradiction; otherwise ``≤ r·(1 + 1e-6)``.
    """
    r = torch.nan_to_num(radius, nan=0.0)
    inside = unsafe < r * (1 - 1e-6) if strict else unsafe <= r * (1 + 1e-6)
    return inside & (r > 0) & applicable


def _indices(mask: Tensor) -> list[int]:
    return [int(i) for i in torch.nonzero(mask).squeeze(1)[:_NAMED]]


@dataclass(frozen=True)
class SafetyQuantification:
    """DeepQuant over a data set (:func:`quantify_safety`): per-input CPU tensors and the gated value.

    ``value``: the lower ``quantile`` (``quantile=0``: the minimum) of the applicable inputs'
    gated radii (``statistic``: ``"certified"`` or ``"estimate"``; NaN when the certificate is
    missing, ``inconclusive`` saying why). ``radius``: the estimates ``s(x)/Q``; ``certified``:
    the certified L∞ radii (or None, ``certified_reason`` saying why); ``gated``: the radii
    compared. ``unsafe_distance``: the nearest point with ``s < 0`` found by the pattern
    search, the gradient ascent or the PGD check; ``pgd_distance``: the PGD check's alone.
    ``worst``: JSON-able dicts of the inputs with the smallest gated radii; ``worst_points``:
    ``(x, x̂)`` CPU tensor pairs for them.
    """

    value: float
    quantile: float
    n: int
    s: Tensor
    q: Tensor
    radius: Tensor
    iterations: Tensor
    evaluations: Tensor
    converged: Tensor
    unsafe_distance: Tensor
    linf_distance: Tensor
    applicable: Tensor
    outputs: str
    settings: dict[str, Any]
    worst: tuple[dict[str, Any], ...] = ()
    worst_points: tuple[tuple[Tensor, Tensor], ...] = field(default=(), compare=False, repr=False)
    certified: Tensor | None = None
    certified_method: str | None = None
    certified_reason: str | None = None
    statistic: str = "certified"
    q_ratio: Tensor | None = None
    q_gradient: Tensor | None = None
    pgd_distance: Tensor | None = None
    pgd_reason: str | None = None
    #: the search that ran (:mod:`.scale`): ``"coordinate"``, ``"gradient"`` or ``"certified"``
    search: str = "coordinate"
    #: its estimated single-input forwards per input, and what they are made of
    queries: float | None = None

    @property
    def n_applicable(self) -> int:
        return int(self.applicable.sum())

    @property
    def label(self) -> str:
        """How the gated statistic is named: ``certified (CROWN)`` or ``estimate (heuristic …)``."""
        if self.statistic == "certified":
            return f"certified ({(self.certified_method or self.settings.get('certified') or 'crown').upper()})"
        return self.estimate_label

    @property
    def estimate_label(self) -> str:
        """How the estimate is named: the pattern search's heuristic, or the attack's upper-bound-style estimate."""
        return STATISTIC_LABELS["estimate" if self.search == "coordinate" else self.search]

    @property
    def estimate_value(self) -> float:
        """The same quantile of the estimates ``s(x)/Q``."""
        return _quantile(self.radius, self.quantile)

    @property
    def certified_value(self) -> float | None:
        """The same quantile of the certified radii, or None without a certificate."""
        if self.certified is None:
            return None
        return _quantile(self.certified, self.quantile)

    @property
    def gated(self) -> Tensor:
        """The per-input radii the gate compares (NaN for all without a certificate when it is the statistic)."""
        if self.statistic == "estimate":
            return self.radius
        return self.certified if self.certified is not None else torch.full_like(self.radius, math.nan)

    @property
    def inconclusive(self) -> str | None:
        """Why nothing sound can be gated: the certified statistic without a certificate; or None."""
        if self.statistic != "certified" or self.certified is not None:
            return None
        return (f"statistic='certified' (the default) needs a certified radius, but the bounds do not cover the "
                f"model: {self.certified_reason}. Fix: make the model one the bounds cover (logits out, supported "
                f"layers), or gate the heuristic estimate explicitly with statistic='estimate' (not a guarantee).")

    @property
    def closer_than_estimate(self) -> Tensor:
        """Per input: an adversarial example (``s < 0``) was found inside the estimated safe radius."""
        # the attack's estimate *is* the distance of its nearest adversarial example: only a closer one refutes it
        return _closer(self.unsafe_distance, self.radius, self.applicable, strict=self.search == "gradient")

    @property
    def closer_than_gated(self) -> Tensor:
        """Per input: an adversarial example was found inside the gated radius."""
        if self.statistic == "estimate":
            return self.closer_than_estimate
        if self.certified is None:
            return torch.zeros_like(self.applicable)
        return _closer(self.unsafe_distance, self.certified, self.applicable, strict=True)

    @property
    def contradiction(self) -> str | None:
        """Why the gated radius is refuted (an adversarial example inside it), or None."""
        bad = self.closer_than_gated
        if not bool(bad.any()):
            return None
        named = _indices(bad)
        i = named[0]
        count = int(bad.sum())
        found = (f"{count} input(s) have an adversarial example (s < 0) closer than their gated radius, the first "
                 f"{', '.join(f'#{j}' for j in named)}; input #{i}: s < 0 at {self.settings['norm']} distance "
                 f"{float(self.unsafe_distance[i]):.6g}")
        if self.statistic == "estimate":
            return (f"{found} inside the estimated safe radius {float(self.radius[i]):.6g} (the estimate s(x)/Q is a "
                    f"heuristic and is refuted there). Fix: gate the certified radius (statistic='certified', the "
                    f"default), or raise iterations/starts/ascent_starts so that the search finds the steepness.")
        return (f"{found} inside the certified radius {float(self.certified[i]):.6g} (unsound bounds: the traced "
                f"graph does not compute what the model computes). Please report this with the model.")

    def _what(self) -> str:
        st = self.settings
        label = f", label={st['label']}" if st["label"] is not None else ""
        return f"{st['expression']}{label}, ε={st['eps']:g}, {st['norm']} d={st['d']:g}"

    def _pgd_counts(self) -> dict[str, Any]:
        ok = self.applicable
        est, gated = self.closer_than_estimate, self.closer_than_gated
        return {
            "steps": self.settings.get("pgd_steps"), "restarts": self.settings.get("pgd_restarts"),
            "checked": int(ok.sum()) if self.pgd_distance is not None else 0,
            "found": int((torch.isfinite(self.pgd_distance) & ok).sum()) if self.pgd_distance is not None else 0,
            "closer_than_gated": int(gated.sum()), "closer_than_gated_first": _indices(gated),
            "closer_than_estimate": int(est.sum()), "closer_than_estimate_first": _indices(est),
            "reason": self.pgd_reason,
        }

    def detail(self) -> str:
        """``min safe radius, certified (CROWN) 0.0213 (…); estimate (heuristic …) min 0.03; PGD check: …``."""
        st = self.settings
        which = "min" if self.quantile == 0 else f"q{self.quantile:g}"
        gated = "n/a" if math.isnan(self.value) else f"{self.value:.4g}"
        how = (f"{st['method']} ≤{st['iterations']} it." if self.search == "coordinate" else
               f"search={self.search}, {st.get('attack_steps')} attack steps")
        text = (f"{which} safe radius, {self.label} {gated} ({self._what()}; {self.n_applicable}/{self.n} inputs, "
                f"{how})")
        if self.statistic == "certified" and self.search != "certified":
            text += f"; {self.estimate_label} {which} {self.estimate_value:.4g}"
        elif self.certified is not None:
            text += f"; certified ({(self.certified_method or '').upper()}) {which} {self.certified_value:.4g}"
        pgd = self._pgd_counts()
        if pgd["checked"]:
            first = "".join(f" #{i}" for i in pgd["closer_than_gated_first"])
            text += (f"; PGD check: {pgd['checked']} inputs, {pgd['closer_than_gated']} with an adversarial example "
                     f"closer than the gated radius{':' + first if first else ''}")
            if self.statistic == "certified":
                text += f" ({pgd['closer_than_estimate']} closer than the estimate)"
        else:
            text += f"; PGD check not run ({self.pgd_reason})"
        if self.worst:
            w = self.worst[0]
            text += f"; worst input #{w['index']}: s={w['s']:.3g}, Q≥{w['q']:.3g}"
        return text

    def to_details(self) -> dict[str, Any]:
        """JSON-able details (plain str/int/float/bool/list/dict/None only)."""
        ok = self.applicable
        radius = self.radius[ok]
        q = self.q[ok]
        details: dict[str, Any] = {
            "metric": f"safe_radius_{self.statistic}",
            "statistic": self.statistic,
            "statistic_label": self.label,
            "value": _num(self.value),
            "quantile": float(self.quantile),
            "n": int(self.n),
            "n_applicable": self.n_applicable,
            "not_applicable": int(self.n - self.n_applicable),
            "outputs": self.outputs,
            "search": self.search,
            "queries_per_input": self.queries,
            "estimate": {
                "value": _num(self.estimate_value),
                "min": _num(float(radius.min())) if radius.numel() else None,
                "median": _num(_quantile(radius, 0.5)),
                "mean": _num(float(radius.mean())) if radius.numel() else None,
                "max": _num(float(radius.max())) if radius.numel() else None,
                "at_d": int((radius >= self.settings["d"]).sum()),
                "note": _ESTIMATE_NOTES[self.search],
            },
            "lipschitz": {"max": _num(float(q.max())) if q.numel() else None, "median": _num(_quantile(q, 0.5))},
            "pgd_check": self._pgd_counts(),
            "unsafe_centres": int(((self.s < 0) & ok).sum()),
            "unsafe_found": int((torch.isfinite(self.unsafe_distance) & ok).sum()),
            "converged": int((self.converged & ok).sum()),
            "iterations_mean": _num(float(self.iterations[ok].double().mean())) if radius.numel() else None,
            "evaluations": int(self.evaluations.sum()),
            "worst": [dict(w) for w in self.worst],
            "settings": dict(self.settings),
        }
        for name, part in (("ratio_median", self.q_ratio), ("gradient_median", self.q_gradient)):
            if part is not None:
                details["lipschitz"][name] = _num(_quantile(part[ok], 0.5))
        if self.certified is not None:
            c = self.certified[ok]
            details["certified"] = {
                "method": self.certified_method, "norm": "linf", "value": _num(self.certified_value),
                "min": _num(float(c.min())) if c.numel() else None, "median": _num(_quantile(c, 0.5)),
                "note": "proved: s ≥ 0 on the whole L∞ ball of this radius ∩ clip (a lower bound on the safe "
                        "radius; for l2/l1 balls too, which the L∞ ball contains)"}
        else:
            details["certified"] = None
            details["certified_reason"] = self.certified_reason
        return details


def quantify_safety(
    model: Any,
    data: Any,
    safety: SafetyProperty,
    search: SearchBudget = SearchBudget(),
    certification: Certification | None = Certification(),
    gated: GatedRadius = GatedRadius(),
    *,
    seed: int = 0,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    outputs: str = "auto",
    shard: Any = None,
    plan: SearchPlan = SearchPlan(search="coordinate"),
) -> SafetyQuantification:
    """:func:`lipschitz_search` (and :func:`certified_radius` with a ``certification``) over ``data``.

    ``data``: anything :func:`~pytest_dnnsafety.data.forms.iter_batches` reads (labels are not used).
    ``safety``, ``search``: the property and the search's budget (:mod:`.options`); the PGD check
    runs ``search.iterations`` steps with ``search.starts`` restarts. ``certification``: the
    certified radius's bound method and bisection steps (None: no certificate). ``gated``: what
    ``value`` is — the ``quantile`` of the ``"certified"`` radii (the default; needs a
    ``certification``) or of the ``"estimate"`` — and the ``worst`` inputs kept and the PGD check
    (:class:`~.options.GatedRadius`).
    Batches of ``batch_size`` inputs; each input's random draws are keyed by its index in the
    data, so the batch size does not change the numbers. ``device`` is used only for a model
    without parameters. The certificate's bounded model is built once; a model it does not
    cover gives ``certified=None`` and the reason.

    The batches go through a :class:`~pytest_dnnsafety.engines.core.runner.Runner` (a ``DataLoader``
    streams) into a :class:`.engine.SafeRadiusEngine`, which keeps each input's results (the
    quantile needs them all: a few scalars per input, never the inputs) and the ``worst`` inputs.
    ``shard``: this torchrun rank's :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of the data; the draws are
    keyed by the global input index, and the engine is all-reduced, so every rank gets the
    single-process result.

    ``plan`` (:class:`~.options.SearchPlan`): which search runs — resolved on the first batch from one input's size
    (:func:`.scale.plan_search`), refused with a :class:`ConfigError` naming the estimate when it exceeds
    ``plan.max_queries`` forwards per input. ``"gradient"``: the estimate is a minimum-norm attack's nearest
    adversarial distance and the attack is the check; ``"certified"``: no estimate, a PGD check of
    ``plan.attack_steps`` steps inside the certified radius.
    """
    from pytest_dnnsafety.engines.bounds.model import BoundedModel, UnsupportedLayerError

    batch_size = check_count(batch_size, "batch_size", 1)
    statistic, quantile, worst = gated.statistic, gated.quantile, gated.worst
    if certification is None and statistic == "certified":
        raise ConfigError("statistic='certified' needs a certified radius, but certified is off (certified=False/"
                          "None). Fix: keep certified=True (CROWN) or 'ibp', or gate the heuristic estimate "
                          "explicitly with statistic='estimate'.")
    certified, steps = (None, 0) if certification is None else (certification.method, certification.steps)
    expression, label, eps, d, norm = safety.expression, safety.label, safety.eps, safety.d, safety.norm
    iterations, starts, max_batch = search.iterations, search.starts, search.max_batch
    runner = Runner("min_safe_radius", model=model, device=device, batch_size=batch_size, labels="ignored",
                    shard=shard)
    guard = runner.guard("min_safe_radius: model on the pattern search's points")
    bounded, reason = None, None
    if certified is not None:
        try:
            bounded = BoundedModel(model)
        except UnsupportedLayerError as exc:
            reason = str(exc)
    if plan.search == "certified" and statistic == "estimate":
        raise ConfigError("@pytest.mark.min_safe_radius: search='certified' computes no estimate, but "
                          "statistic='estimate' gates it. Fix: use search='gradient' or 'coordinate', or gate the "
                          "certified radius (statistic='certified').")
    engines: list[SafeRadiusEngine] = []  # built on the first batch (the inputs' shape and dtype)
    outputs_seen, settings = outputs, {}
    chosen: dict[str, Any] = {}  # the resolved search, its estimate and bound method (on the first batch)
    pgd_reason: str | None = None if gated.pgd_check else "pgd_check=False"

    def step(batch: Batch) -> None:
        nonlocal outputs_seen, settings, bounded, reason, pgd_reason, certified
        x, start = batch.x, batch.start
        if not chosen:
            mode, queries, _, certified = resolve_search(plan, math.prod(x.shape[1:]), search, certified, steps)
            chosen.update(search=mode, queries=queries)
        mode = chosen["search"]
        if mode == "coordinate":
            res = lipschitz_search(model, x, safety, search, seed=seed, index_offset=start, outputs=outputs_seen,
                                   guard=guard)
        else:
            res = gradient_search(model, x, safety, plan if mode == "gradient" else SearchPlan(attack_steps=0),
                                  outputs=outputs_seen, guard=guard, max_batch=max_batch)
            if mode == "certified":
                res = replace(res, radius=torch.where(res.applicable, torch.full_like(res.s, math.nan), res.radius))
        outputs_seen, settings = res.outputs, {**res.settings, "search": mode}  # detected once, on the first batch
        if mode != "coordinate":
            settings["attack_steps"] = plan.attack_steps
        if not engines:
            engines.append(SafeRadiusEngine(worst, tuple(res.x_hat.shape[1:]), str(res.x_hat.dtype).split(".")[-1],
                                            device=res.s.device))
        cert = None
        if bounded is not None:
            cert, why = certified_radius(model, x, expression, d=d, label=label, eps=eps, clip=safety.clip,
                                         method=certified, steps=steps, outputs=outputs_seen,
                                         bounded=bounded)
            if cert is None:
                bounded, reason = None, why
        xin = x.to(res.x_hat.dtype)
        unsafe, pgd = res.unsafe_distance, None
        if pgd_reason is None and mode == "gradient":  # the attack is the check: its nearest adversarial distances
            pgd = torch.where(res.applicable, res.unsafe_distance, torch.full_like(res.unsafe_distance, math.inf))
        elif pgd_reason is None and mode == "certified":  # PGD inside the certified radius
            if cert is not None:
                found = pgd_nearest_unsafe(
                    model, xin, settings["expression"], settings["eps"], outputs_seen, res.top, res.other,
                    torch.nan_to_num(cert, nan=0.0) * _INSIDE, norm="linf",
                    clip=settings["clip"] and tuple(settings["clip"]), steps=plan.attack_steps, restarts=1,
                    seed=seed, index=batch.rows.to(xin.device), max_batch=max_batch, guard=guard)
                if found is None:
                    pgd_reason = _NO_GRADIENT
                else:
                    pgd = torch.where(res.applicable, found[0], torch.full_like(found[0], math.inf))
                    unsafe = torch.minimum(unsafe, pgd)
        elif pgd_reason is None:
            # PGD inside the estimated radius and, when it is gated, the certified one (one batch of 2N rows)
            claims = [res.radius] + ([cert] if statistic == "certified" and cert is not None else [])
            radii = torch.nan_to_num(torch.cat(claims), nan=0.0) * _INSIDE
            k = len(claims)
            found = pgd_nearest_unsafe(
                model, xin.repeat(k, *(1,) * (xin.ndim - 1)), settings["expression"], settings["eps"], outputs_seen,
                res.top.repeat(k), res.other.repeat(k), radii, norm=norm, clip=settings["clip"] and tuple(
                    settings["clip"]), steps=iterations, restarts=starts, seed=seed,
                index=batch.rows.to(xin.device).repeat(k), max_batch=max_batch, guard=guard)
            if found is None:
                pgd_reason = _NO_GRADIENT
            else:
                pgd = found[0].reshape(k, -1).amin(dim=0)
                pgd = torch.where(res.applicable, pgd, torch.full_like(pgd, math.inf))
                unsafe = torch.minimum(unsafe, pgd)
        linf = (res.x_hat - xin).flatten(1).abs().amax(dim=1).to(torch.float64)
        values = {"s": res.s, "q": res.q, "radius": res.radius, "iterations": res.iterations,
                  "evaluations": res.evaluations, "converged": res.converged, "unsafe": unsafe, "linf": linf,
                  "applicable": res.applicable, "certified": cert, "q_ratio": res.q_ratio,
                  "q_gradient": res.q_gradient, "pgd": pgd}
        compared = cert if statistic == "certified" and cert is not None else res.radius
        engines[0].update(start, values, gated=compared, x=xin, x_hat=res.x_hat, s_hat=res.s_hat,
                          dist=lp_norm((res.x_hat - xin).flatten(1).to(torch.float64), res.settings["norm"]))

    runner.run(data, step, lambda: engines[0])  # built on the first batch (every shard holds one)
    engine = engines[0]
    out = engine.compute()
    applicable = out["applicable"]
    if not bool(applicable.any()):
        raise MetricError(f"min_safe_radius: the expression {expression!r} applies to no input: every input's top "
                          f"class is the other class (label={label!r}). Fix: pick another label, or use "
                          f"expression='top_vs_runner_up'.")
    if out["no_certificate"] and reason is None and certified is not None:
        reason = "the certified bounds failed on another torchrun rank's shard"
    if out["no_pgd"] and pgd_reason is None:
        pgd_reason = _NO_GRADIENT
    cert_all = out["certified"] if certified is not None and not out["no_certificate"] else None
    if statistic == "estimate":
        value = _quantile(out["radius"], float(quantile))
    else:
        value = math.nan if cert_all is None else _quantile(cert_all, float(quantile))
    listed, points = _worst_list(engine, out["worst_rows"], norm, cert_all is not None)
    settings = {**settings, "statistic": statistic, "certified": certified,
                "pgd_steps": iterations if chosen.get("search") == "coordinate" else plan.attack_steps,
                "pgd_restarts": starts if chosen.get("search") == "coordinate" else 1}
    return SafetyQuantification(
        value=value, quantile=float(quantile), n=out["n"], s=out["s"], q=out["q"], radius=out["radius"],
        iterations=out["iterations"], evaluations=out["evaluations"], converged=out["converged"],
        unsafe_distance=out["unsafe"], linf_distance=out["linf"], applicable=applicable, outputs=outputs_seen,
        settings=settings, worst=listed, worst_points=points, certified=cert_all,
        certified_method=certified if cert_all is not None else None,
        certified_reason=None if cert_all is not None else (reason or "not requested (certified=False)"),
        statistic=statistic, q_ratio=out["q_ratio"], q_gradient=out["q_gradient"],
        pgd_distance=out["pgd"] if pgd_reason is None else None, pgd_reason=pgd_reason,
        search=chosen.get("search", "coordinate"), queries=chosen.get("queries"))


def _worst_list(engine: SafeRadiusEngine, rows: Tensor | None, norm: str,
                with_cert: bool) -> tuple[tuple[dict[str, Any], ...], tuple[tuple[Tensor, Tensor], ...]]:
    """The kept worst rows as JSON-able dicts and their ``(x, x̂)`` pairs (inputs the expression skips left out)."""
    if rows is None:
        return (), ()
    rows = rows[rows[:, WORST_COLUMNS.index("applicable")] != 0]
    col = {name: rows[:, i].tolist() for i, name in enumerate(WORST_COLUMNS)}
    listed, pairs = [], engine.worst_points(rows)
    for i, (_, x_hat) in enumerate(pairs):
        entry: dict[str, Any] = {
            "index": int(col["index"][i]), "s": col["s"][i], "q": col["q"][i], "estimate": col["estimate"][i],
            "gated": _num(col["key"][i]), "s_hat": col["s_hat"][i], "linf_distance": col["linf"][i],
            f"{norm}_distance": col["dist"][i], "iterations": int(col["iterations"][i]),
            "unsafe_distance": _num(col["unsafe"][i]),
        }
        if with_cert:
            entry["certified"] = _num(col["certified"][i])
        if x_hat.numel() <= 4096:
            entry["x_hat"] = [round(float(v), 6) for v in x_hat.reshape(-1).tolist()]
        listed.append(entry)
    return tuple(listed), tuple(pairs)
