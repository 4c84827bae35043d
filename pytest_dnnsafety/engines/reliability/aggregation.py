"""Aggregation of a reliability assessment into bounds: E, Var and Ub by each method (eqs. 5–7 and the sound ones).

Part of :mod:`pytest_dnnsafety.engines.reliability`: :class:`BoundAggregator` holds the aggregation
steps of :class:`~pytest_dnnsafety.engines.reliability.ReliabilityAssessor` (a mixin). With
bootstrap replicate masses the sound methods take a quantile over replicates; beyond
``planning.HELD_REPLICATES`` entries the replicates are streamed over cells
(:meth:`BoundAggregator._streamed_bound`) with the held computation's values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pytest_dnnsafety.stats import intervals as stats
from pytest_dnnsafety.engines.reliability.result import MethodBound


class BoundAggregator:
    """The aggregation half of :class:`~pytest_dnnsafety.engines.reliability.ReliabilityAssessor` (a mixin)."""

    def _bound(self, method: str, op: Tensor, op_var: Tensor, reps: Tensor | None, rest: float,
               rest_reps: Tensor | None, cross: Tensor, sampled: Tensor, fails: Tensor, trials: Tensor
               ) -> MethodBound:
        conf = self.confidence
        lam_mean = torch.ones_like(op)
        lam_var = torch.zeros_like(op)
        if sampled.numel():
            m, v = stats.binomial_moments(fails, trials)
            lam_mean[sampled], lam_var[sampled] = m, v
        normal = stats.aggregate_normal(op, op_var, lam_mean, lam_var, conf)
        rest_var = float(rest_reps.var(unbiased=True)) if (rest_reps is not None and self.conservative_rest) else 0.0
        E = normal.E + rest
        Var = normal.Var + rest_var
        if method == "normal":
            return MethodBound(method, E, Var, stats.normal_upper(E, Var, conf), conf)
        if reps is None and getattr(self, "_streamed", None) is not None:  # replicate masses not held
            if method != "jeffreys":
                ub = self._streamed_bound(method, rest_reps, cross, sampled, fails, trials)
                return MethodBound(method, E, Var, min(1.0, ub), conf)
            reps = torch.cat([chunk.cpu() for _, chunk in self._replicate_chunks()], 1)  # jeffreys needs them all
        ops = op[None, :] if reps is None else reps
        rests = torch.tensor([rest]) if reps is None else (rest_reps if self.conservative_rest
                                                             else torch.zeros(reps.shape[0], dtype=torch.float64))
        assert rests is not None
        cross_mass = ops[:, cross].sum(1) + rests  # (B,) or (1,)
        if method == "jeffreys":
            draws = stats.jeffreys_draws(ops[:, sampled], fails, trials, self.posterior_draws, seed=self.seed,
                                         extra=cross_mass)
            ub = float(torch.quantile(draws, conf))
            return MethodBound(method, float(draws.mean()), float(draws.var()), min(1.0, ub), conf)
        alpha = 1.0 - conf
        if reps is None:
            conf_lam, level = conf, None
        else:
            alpha_op = self.alpha_op_share * alpha
            conf_lam, level = 1.0 - (alpha - alpha_op), 1.0 - alpha_op
        if not sampled.numel():
            values = cross_mass.tolist()
        elif method == "chernoff" and self._strata is not None:  # adaptive: per stratum at α_λ/G, summed
            values = [float(cross_mass[b]) + stats.stratified_chernoff_upper(ops[b, sampled], fails, trials,
                                                                             self._strata, conf_lam)
                      for b in range(ops.shape[0])]
        elif method == "chernoff":
            values = [float(cross_mass[b]) + stats.chernoff_upper(ops[b, sampled], fails, trials, conf_lam)
                      for b in range(ops.shape[0])]
        else:  # clopper-pearson: the per-cell bounds (at 1 − α_λ/m) do not depend on the masses
            per_cell = stats.clopper_pearson_upper(fails, trials, 1.0 - (1.0 - conf_lam) / int(sampled.numel()))
            values = (ops[:, sampled] @ per_cell + cross_mass).tolist()
        ub = values[0] if level is None else stats.bootstrap_quantile(values, level)
        return MethodBound(method, E, Var, min(1.0, ub), conf)

    def _streamed_bound(self, method: str, rest_reps: Tensor | None, cross: Tensor, sampled: Tensor, fails: Tensor,
                        trials: Tensor) -> float:
        """``"chernoff"`` (stratified with ``allocation="adaptive"``) or ``"clopper-pearson"`` of :meth:`_bound`, the
        replicate masses streamed over cells: per replicate and stratum the mass, ``max w_i`` and ``Σ w_i k_i``
        (or the Clopper–Pearson dot product) accumulate chunk by chunk — the held computation's values."""
        alpha = 1.0 - self.confidence
        alpha_op = self.alpha_op_share * alpha
        conf_lam, level = 1.0 - (alpha - alpha_op), 1.0 - alpha_op
        n_b, n_s = self.bootstrap, int(sampled.numel())
        pos = torch.full((int(self._flat.shape[0]),), -1, dtype=torch.int64)
        pos[sampled] = torch.arange(n_s)
        strata = self._strata if (method == "chernoff" and self._strata is not None) else \
            torch.zeros(n_s, dtype=torch.int64)
        n_g = int(strata.max()) + 1 if n_s else 1
        crossed = (rest_reps.clone() if (rest_reps is not None and self.conservative_rest)
                   else torch.zeros(n_b, dtype=torch.float64))
        mass, w_max, wk = (torch.zeros(n_b, n_g, dtype=torch.float64) for _ in range(3))
        dot = torch.zeros(n_b, dtype=torch.float64)
        per_cell = (stats.clopper_pearson_upper(fails, trials, 1.0 - (1.0 - conf_lam) / n_s)
                    if method == "clopper-pearson" and n_s else None)
        k64, n64 = fails.to(torch.float64), trials.to(torch.float64)
        for start, chunk in self._replicate_chunks():
            chunk = chunk.cpu()
            stop = start + chunk.shape[1]
            crossed += chunk[:, cross[start:stop]].sum(1)
            p = pos[start:stop]
            here = p >= 0
            if not bool(here.any()):
                continue
            idx = p[here]
            o = chunk[:, here]
            if per_cell is not None:
                dot += o @ per_cell[idx]
                continue
            w = o / n64[idx]
            g = strata[idx]
            for gg in range(n_g):  # a handful of strata
                sel = g == gg
                if bool(sel.any()):
                    mass[:, gg] += o[:, sel].sum(1)
                    w_max[:, gg] = torch.maximum(w_max[:, gg], w[:, sel].max(1).values)
                    wk[:, gg] += w[:, sel] @ k64[idx][sel]
        if not n_s:
            values = crossed.tolist()
        elif per_cell is not None:
            values = (dot + crossed).tolist()
        else:
            values = []
            for b in range(n_b):
                live = torch.nonzero(mass[b] > 0).reshape(-1).tolist()
                conf_g = 1.0 - (1.0 - conf_lam) / max(1, len(live))
                total = sum(min(float(mass[b, g]), float(w_max[b, g]) *
                                stats.poisson_chernoff_mu(float(wk[b, g]) / float(w_max[b, g]), conf_g))
                            for g in live)
                values.append(float(crossed[b]) + total)
        return stats.bootstrap_quantile(values, level)
