"""The public entry point of the reliability assessment: :func:`assess_reliability`.

Part of :mod:`pytest_dnnsafety.engines.reliability`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Tensor

from pytest_dnnsafety.engines.reliability.assessment import ReliabilityAssessor
from pytest_dnnsafety.engines.reliability.options import ReliabilityOptions
from pytest_dnnsafety.engines.reliability.result import ReliabilityResult
from pytest_dnnsafety.engines.reliability.profile import OperationalProfile


def assess_reliability(
    model: Callable[[Tensor], Any],
    profile: OperationalProfile | Any,
    labelled: tuple[Any, Any] | None = None,
    **options: Any,
) -> ReliabilityResult:
    """Assess the pmi of ``model`` under the operational profile (Zhao et al. 2021) and bound it.

    ``options`` are the fields of the option records that :class:`ReliabilityAssessor` takes
    (:class:`~pytest_dnnsafety.engines.reliability.options.ReliabilityOptions`: the defaults are theirs;
    built by :meth:`~pytest_dnnsafety.engines.reliability.options.ReliabilityOptions.of`), all documented
    here; an unknown keyword raises ``TypeError``.

    Args:
        model: a torch module or any callable mapping inputs ``(B, *input_shape)`` (on ``device``,
            ``input_dtype``) to logits or probabilities ``(B, K)`` or integer labels ``(B,)``.
        profile: an :class:`~pytest_dnnsafety.engines.reliability.profile.OperationalProfile`, or raw operational
            data ``(N, d)`` to build one from (with ``bandwidth``).
        labelled: ``(x, y)`` labelled inputs (input space; encoded when the profile is latent):
            they give ``r̂`` and the labels of normal/cross-boundary cells. With ``cells="balls"``
            also a ``DataLoader`` of ``(x, y)`` batches in index order, streamed (never held whole;
            :mod:`~pytest_dnnsafety.engines.reliability.streamed`).
        eps: cell side (number, or one per dimension), or ``"auto"`` — the largest even split of
            the box with side below ``eps_fraction · r̂``.
        box: ``(lower, upper)`` corners of the gridded domain (profile space). Default ``None``: the
            data's range — the bounding box of the operational and the labelled points, no padding.
            ``"padded"``: that range widened by three kernel standard deviations per side (the KDE's
            tails; earlier releases padded by default). The box used is reported (``result.box``,
            ``box_rule``). With ``normalize=True`` the masses are renormalised over the box, so the
            KDE mass that spills over the unpadded box (kernels at the edge of the data) is shared
            out over the cells in it rather than counted as unevaluated rest.
        samples_per_cell: Monte Carlo samples ``n`` per cell (eqs. 13–14); with
            ``allocation="proportional"`` the same total budget is spread ``∝ Op_i`` (which
            minimises the ``"chernoff"`` bound's ``max Op_i/n_i``).
        allocation: ``"uniform"`` (default; ``samples_per_cell`` in every cell, the paper's),
            ``"proportional"`` (above) or ``"adaptive"`` — sound adaptive allocation
            (:mod:`~pytest_dnnsafety.engines.reliability.allocation`; beyond the paper): a pilot of
            ``n₀`` samples per cell, then strata from the pilot only (cells with pilot failures /
            without), one weight ``w_g`` per stratum chosen to minimise the bound the pilot predicts,
            ``n_i = ⌈max_b Op_{b,i} / w_g⌉`` fresh samples per cell from an independent seed stream,
            and for ``method="chernoff"`` the stratified bound
            (:func:`~pytest_dnnsafety.stats.intervals.stratified_chernoff_upper`: each stratum at ``α_λ/G``,
            summed) — sound for every failure-rate vector because the plan depends on the pilot
            only. Empty cells take the pilot's vote as their label. The result reports
            ``queries_pilot``, ``queries_final`` and the plan (``allocation_plan``). Every rank
            runs the (deterministic) pilot in full; the final stage shards by ``rank``/``world_size``.
        query_budget: ``allocation="adaptive"``: the total Monte Carlo queries, pilot included
            (default ``samples_per_cell`` × the sampled cells — the uniform budget). Must pay the
            pilot and one final sample per cell (a :class:`ConfigError` says how many).
        target_width: ``allocation="adaptive"``: plan the fewest queries whose *predicted* width
            ``Ub − E`` is at most this (within ``query_budget`` when given). The plan is chosen once
            from the pilot; nothing is re-tested sequentially. ``allocation_plan["target_reached"]``
            says whether the prediction reached it; the summary says whether the result did.
        max_queries: the most Monte Carlo queries a plan may take (default 10⁹; ``None``: no
            cap). A plan above it — ``samples_per_cell`` × cells, an adaptive ``query_budget`` or
            pilot, or the plan a tiny ``target_width`` asks for (checked after the pilot) — is
            refused before it is sampled with a ``QueryCapError`` (a ``ConfigError``) naming the
            planned queries, the time they would take and the fix.
        pilot_samples: ``allocation="adaptive"``: pilot samples per cell (default
            ``pilot_fraction`` of ``query_budget`` spread over the cells, or of
            ``samples_per_cell`` when only ``target_width`` is given; at least 1).
        pilot_fraction: the pilot's share (strictly between 0 and 1, default 0.05), see above.
        bootstrap: KDE refits ``B`` for ``V[Op_i]`` (Appendix A); 0 takes the masses as known.
        bootstrap_size: ``"full"`` (default) — the standard (Efron) bootstrap, each refit resamples
            ``N`` of the ``N`` operational points, so ``V[Op_i]`` is the variance of the masses
            actually used; ``"half"`` — the paper's reference implementation, refits on ``N/2``-point
            resamples (an m-out-of-n bootstrap), which estimates the variance of a KDE fitted on
            half the data: about 2× the full-size ``V[Op_i]`` (a KDE mass's variance scales as
            ``1/N``). Use ``"half"`` to reproduce the paper's figures. Grid cells only.
        bandwidth: KDE bandwidth (rule name, number or one per dimension); with an existing
            profile it refits the profile with this bandwidth.
        mass: ``"exact"`` box integrals or ``"centre"`` (the paper's eq. 9; ``"center"`` is accepted
            and reported as ``"centre"``).
        normalize: normalise masses over the box (the evaluated domain); otherwise the KDE mass
            outside the box joins the unevaluated rest.
        mass_target, max_cells: take cells by descending OP mass until their share reaches
            ``mass_target`` and/or ``max_cells`` cells.
        conservative_rest: count the unevaluated mass with ``λ = 1`` (default); ``False`` assumes the
            evaluated cells' average pmi for it.
        num_classes: number of classes (needed only when the model returns labels and cannot
            predict every class).
        failures: ``[(true, predicted), …]`` critical confusions; default any misclassification.
        method: ``"chernoff"`` (sound; default), ``"normal"`` (the paper's eq. 7),
            ``"clopper-pearson"`` (sound, Bonferroni) or ``"jeffreys"`` (Bayesian); see
            :mod:`pytest_dnnsafety.stats.intervals`. ``compare_methods`` adds others to ``alternatives``.
        confidence: ``1 − α`` of the bound, strictly between 0 and 1 (the paper: 0.975).
        alpha_op_share: the share of ``α`` the sound methods spend on OP uncertainty (bootstrap).
        posterior_draws: Monte Carlo draws for ``"jeffreys"``.
        seed: seeds the bootstrap, the cell samples and the posterior draws.
        device: where sampling and model calls happen (default: the profile's device).
        batch_size: model batch (rounded to blocks of :data:`BLOCK` samples; ball cells of more
            than 1,024 values per input use smaller blocks, :func:`block_size`) or ``"auto"`` (timed
            on the first batches, from about 8 MiB of image inputs on a CPU; results do not depend on it).
        input_dtype: dtype of the model inputs.
        cells: ``"grid"`` (default; the arguments above) or ``"balls"`` — norm-ball cells around
            the operational inputs (Zhao et al. 2021, §IV: "cells … are norm balls around operational
            inputs"; the paper's remedy for high-dimensional inputs such as images):

            * ``profile`` gives the centres: raw operational inputs ``(N, *input_shape)`` (images
              are fine: no KDE is fitted) or an :class:`OperationalProfile` *without* an encoder
              (its data are the inputs). A latent profile holds only encodings: a
              :class:`ConfigError` asks for the raw inputs. Or a ``DataLoader`` of inputs (``x`` or
              ``(x, y)`` batches, in index order): read in passes, never held whole — ``r̂`` and the
              ball types by block nested loops over the labelled data, the samples' centres through
              a window in ball order (:mod:`~pytest_dnnsafety.engines.reliability.streamed`; the
              same numbers as the data held; the cell table then lists no corners). Each of the ``M`` centres ``x_j`` is
              the centre of one cell ``B(x_j, ε) = {x : ‖x − x_j‖ ≤ ε}`` in input space.
            * ``Op_j = 1/M`` — the empirical operational profile (no KDE). With ``bootstrap ≥ 2``
              the OP uncertainty is the bootstrap of the operational sample: replicate ``b``
              gives ball ``j`` the mass ``W_bj/M`` (``W_b`` multinomial resampling counts), and
              ``V[Op_j] = (1/M)(1 − 1/M)/M`` is that bootstrap's exact variance (the multinomial
              variance of an empirical mass), used in eq. (6) without Monte Carlo noise. Eq. (6)
              ignores the multinomial's negative covariances, so its ``Var`` over-states the
              bootstrap variance of ``Σ Op_j λ_j`` — conservative. The sound methods take the
              bound's quantile over the ``W_b/M`` replicates exactly as for KDE masses.
              ``bootstrap=0`` takes the masses ``1/M`` as known (``V[Op_j] = 0``). The estimate
              ``Σ_j λ_j/M`` is the mean unastuteness of the ε-ball around a random operational
              input.
            * Ball types: labelled points (input space, flattened) inside the closed ball decide
              normal (they agree; their label is the ground truth) or cross-boundary (they
              disagree; ``λ_j = 1``); otherwise the ball is empty and its label is the model's
              majority vote on its samples (Assumption 5). Distances are exact, in chunks.
            * ``λ_j`` by Monte Carlo: ``samples_per_cell`` inputs uniform in the ball — L∞:
              uniform in the box ``[x_j − ε, x_j + ε] ∩ clip`` (exactly uniform on the clipped
              ball); L2: ``x_j + ε·U^{1/d}·g/‖g‖`` with ``g`` Gaussian, then clamped to ``clip``
              (the projection puts the mass outside the valid range on its faces; not exactly
              uniform on the clipped ball). Block-seeded as for grid cells: results do not
              depend on ``batch_size``.
            * Aggregation, ``method`` and ``compare_methods`` are the grid's. ``eps``, ``box``,
              ``bandwidth``, ``mass_target`` and ``max_cells`` are grid settings and raise a
              :class:`ConfigError` with balls (``mass``, ``normalize``, ``conservative_rest``
              are ignored: every ball is evaluated, nothing is left over).
        radius: ball radius ``ε`` (input space, under ``norm``), or ``None``/``"auto"``:
            ``min(eps_fraction · r̂, 0.1 · D)`` just below, with ``r̂`` the r-separation of the
            labelled data in input space under ``norm`` (Remark 2: a ball of radius below ``r̂``
            cannot hold inputs of two classes) and ``D`` the diameter under ``norm`` of the
            operational data's bounding box (of the ``clip`` cube when given) — the cap
            (:data:`AUTO_RADIUS_CAP`) keeps balls local when the classes are far apart (for
            images ``r̂`` can be a large share of the pixel range). ``radius ≥ r̂`` warns
            (:class:`ReliabilityWarning`, ``eps_exceeds_r``).
        norm: ``"linf"`` (default) or ``"l2"`` — the balls' norm (and ``r̂``'s for ``"auto"``).
        max_balls: evaluate a seeded random subsample (without replacement, in data order) of
            ``max_balls`` operational inputs; it is itself an empirical profile
            (``Op_j = 1/max_balls``). Default: all.
        clip: ``(lo, hi)`` — the valid input range (e.g. ``(0, 1)`` for images); samples are kept
            in it as above and operational inputs outside it are a :class:`DataError`. Default
            ``None``: no clipping (the plugin cannot know the valid range).

        empty_cell_label: how an empty cell (ball) — no labelled point inside — gets its label:
            ``"model"`` (default, the paper's Assumption 5: the model's majority vote on the
            cell's samples; a region the model gets consistently wrong then counts as correct) or
            ``"nearest"`` (the label of the nearest labelled point to the cell's centre, Euclidean,
            in the profile's space; :func:`nearest_labels`). Reported in ``detail``/``summary``.
        labelled_from_profile: whether the labelled points are a sample of the operational profile
            (default ``True``). Then the model's error on them, ``k`` of ``n``, has an exact
            Clopper–Pearson lower bound at ``confidence``
            (:func:`~pytest_dnnsafety.stats.intervals.labelled_error_check`); above ``Ub`` the labelled data
            refute the bound and the result lists a *contradiction* (check (a)). ``False`` (e.g.
            a curated test set with another class or condition mix) skips check (a) but records
            its figures in ``labelled_check``. Check (b) always runs when empty cells take the
            model's vote: on the evaluated cells holding labelled points (where the ground truth
            is known), the OP-weighted amount ``g`` by which the vote under-states the
            unastuteness; if ``E + g · (OP mass of the empty cells) > Ub`` the vote-labelled empty
            cells cannot be trusted and a contradiction is listed.
        accept_violated_assumptions: recorded in the result (``violations_accepted``); the gate
            compares the bound despite the ``violations`` it lists (``ε``/radius ``≥ r̂``,
            cross-boundary cells, labelled points outside the box) instead of reporting it as
            inconclusive.

    Every model query (Monte Carlo samples, the labelled points) goes through a
    :class:`~pytest_dnnsafety.engines.core.guard.ForwardGuard`: NaN/inf outputs raise a :class:`MetricError`
    naming the first bad batch after the loop (no host sync per batch).

    Raises:
        ConfigError: a bad setting (named, with the fix), e.g. ``eps`` larger than the box or a
            confidence outside (0, 1).
        DataError: empty or non-finite data.
        MetricError: the model's output has the wrong shape, or the profile has no mass in the box.
    """
    started = time.perf_counter()
    assessor = ReliabilityAssessor(profile, labelled, ReliabilityOptions.of(**options))
    engine = assessor.sample(model)
    result = assessor.finish(engine, model_queries=assessor.queries)
    return replace(result, seconds=time.perf_counter() - started)
