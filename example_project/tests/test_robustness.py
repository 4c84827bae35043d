"""Robustness gates for the digits_demo classifier.

Inputs are 8x8 grey images in [0, 1] with 16 grey levels (one level = 1/16 = 0.0625), so every
budget below is stated against that scale. The two empirical gates on the same perturbations
share one run of the attacks; the certified gate proves, input by input, that no perturbation of
the stated size can change the decision.
"""

import pytest

#: The operating conditions of data/conditions.toml, as worst-case budgets per input: sensor
#: noise (sigma 0.05), lighting (brightness +-0.1, contrast +-20%), light lens blur (sigma 0.6 px)
#: and a tilted mount (+-10 degrees).
CONDITIONS = ["gaussian_noise", "brightness", "contrast", "blur", "rotation"]
BUDGETS = {"gaussian_noise": 0.05, "brightness": 0.1, "contrast": 0.2, "blur": 0.6, "rotation": 10}


@pytest.mark.max_adversarial_confidence_loss(0.2, eps=None, families=CONDITIONS, budgets=BUDGETS, clip=(0, 1))
def test_operating_conditions_cost_little_confidence(model, dataset):
    """Under the worst of the operating-condition perturbations, the reader loses on average at
    most 0.2 of its probability for the true digit (-M_adv, Cheng et al. 2018, eq. 4).

    Each family picks, per image, the worse of its two directions (brighter or darker, more or
    less contrast, tilted left or right). Measured: 0.130; the tilt is the worst family for 214 of
    the 539 images and blur for 194 (mean losses 0.077 and 0.046), sensor noise the mildest (0.011).
    """


@pytest.mark.min_robust_accuracy(0.75, eps=None, families=CONDITIONS, budgets=BUDGETS, clip=(0, 1))
def test_digits_stay_readable_under_operating_conditions(model, dataset):
    """At least 75% of the evaluation images are read correctly both as recorded and under every
    operating-condition perturbation above.

    Measured: 0.833 (clean 0.939; per family from 0.881 under tilt to 0.931 under noise).
    Not gated, but recorded: a one-pixel shift (translation, eps=1) leaves only 7% of the images
    robust; the reader relies on centred digits, which the fixed mount guarantees.
    """


@pytest.mark.max_adversarial_confidence_loss(0.25, eps=0.02, families=["fgsm", "pgd"], clip=(0, 1))
def test_sub_grey_level_attacks_cost_bounded_confidence(model, dataset):
    """A worst-case pixel change of 0.02 (a third of one grey level, below the sensor's
    quantisation), found by FGSM and 10-step PGD, costs at most 0.25 of the true digit's
    probability on average.

    Measured: 0.165 (PGD is the worse attack on 90% of the images).
    """


@pytest.mark.min_robust_accuracy(0.7, eps=0.02, families=["fgsm", "pgd"], clip=(0, 1))
def test_most_digits_resist_sub_grey_level_attacks(model, dataset):
    """At least 70% of the images are read correctly under both attacks at eps = 0.02.

    Measured: 0.779 (clean 0.939; FGSM alone 0.787).
    """


@pytest.mark.min_verified_robustness(0.75, eps=0.01, method="crown", clip=(0, 1))
def test_most_digits_are_provably_robust(model, dataset):
    """At least 75% of the evaluation images are *verified*: CROWN bounds prove that no change of
    any pixels by up to 0.01 each (a sixth of a grey level) can change the reader's correct decision.

    Measured: 430/539 = 0.798 verified; 66 falsified (33 misread as recorded, 33 flipped by PGD
    inside the ball: the counterexamples are in the evidence); 43 unknown (neither proved nor
    broken). Interval bounds (method="ibp", the margin folded into the last layer) prove only 30 of the
    539 for this network: CROWN's linear relaxation is what makes the proof possible without certified
    training.
    """


@pytest.mark.min_safe_radius(0.0008, d=0.05, expression="top_vs_runner_up", norm="linf", iterations=10,
                             certified="crown", data="first_100_digits")
def test_decisions_keep_a_safe_margin_around_each_digit(model, first_100_digits):
    """DeepQuant: for each of 100 digits, the L∞ radius within which the top class provably keeps its lead is at
    least 0.0008 (0.08 % of the pixel range, about 1/80 of a grey level).

    The gated value is the radius CROWN *proves* (the default statistic); DeepQuant's estimate s(x)/Q (Q, the
    Lipschitz metric of the margin, found by gradient-norm ascent and pattern search) is reported beside it as a
    heuristic. Every digit is checked by PGD inside its radius. Measured: certified min 0.00093; estimate min
    0.00063; PGD found no adversarial example inside either (before the fix, the old estimate, min 0.0035, was
    refuted by PGD for 55 of the 100 digits, so the threshold came down from 0.001 to the proved radius).
    """
