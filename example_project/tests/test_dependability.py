"""Dependability gates for the digits_demo classifier.

Evidence for the safety case of the digit reader: does the evaluation data exercise the
operating conditions we claim to support (lighting, blur, rotation, sensor noise; see
``data/conditions.toml`` and README.md), and does the model meet its accuracy target there?

The model, evaluation data, scenario table and conditions are configured in ``pyproject.toml``
and regenerated deterministically by ``python -m digits_demo.train``. Thresholds were set from
the measured values of that run (recorded in each docstring) minus a margin, so that a gate
fails when the data or the conditions model regress, not on noise.
"""

import pytest
import torch

# Size of the reviewed conditions model: 4 lighting + 3 blur + 3 rotation + 3 noise values,
# and 63 value pairs of which 2 (bright or normal light with high noise) are impossible.
CONDITION_VALUES = 13
FEASIBLE_PAIRS = 61


@pytest.mark.min_scene_coverage(1.0, k=1)
def test_every_condition_value_is_exercised(scenario_table):
    """Every value of every operating condition occurs at least once in the evaluation data.

    Requirement: no declared operating condition may go entirely untested. Measured: 13/13.
    """
    assert scenario_table.coverage(k=1).total == CONDITION_VALUES


@pytest.mark.min_scene_coverage(0.8, k=2)
def test_data_covers_pairs_of_operating_conditions(scenario_table):
    """The evaluation data covers at least 80% of all feasible 2-way combinations of conditions.

    Measured: 57/61 = 0.934. Known holes from the recording campaign, accepted for now:
    night x heavy blur, bright x heavy blur, and high noise with a tilted (+-15 degree) view.
    The impossible pairs (bright/normal light with high sensor noise) are not counted.
    """
    assert scenario_table.coverage(k=2).total == FEASIBLE_PAIRS


@pytest.mark.min_scene_coverage(0.75, k=3)
def test_data_covers_triples_of_operating_conditions(scenario_table):
    """The evaluation data covers at least 75% of all feasible 3-way combinations of conditions.

    Interactions of three conditions (e.g. dim light, light blur and a tilted view) are where
    perception failures hide. Measured: 102/123 = 0.829; the 21 uncovered triples all extend
    the four known 2-way holes.
    """


def test_night_conditions_are_covered(scenario_table):
    """At night, the evaluation data still covers at least 60% of the 2-way combinations of the
    remaining conditions (blur, rotation, noise).

    Night is the hardest lighting condition for the reader, so it gets its own bound. Measured:
    19/27 = 0.704 (no heavy blur at night; high noise only with a level view).
    """
    night = scenario_table.coverage(k=2, where={"lighting": "night"})
    assert night.value >= 0.6, f"night 2-way coverage {night.value:.3f}; uncovered: {night.uncovered}"


@pytest.mark.min_neuron_k_activation(0.5, layer="classifier.1", k=2)
def test_hidden_features_are_exercised_in_pairs(model, dataset):
    """The evaluation data shows at least half of all on/off patterns of every pair of neurons in
    the hidden dense layer (``classifier.1``, 64 ReLU units), so the high-level features are
    exercised in combination, not only the outputs.

    Measured: 4,580/8,064 = 0.568 (31 of the 64 units never fire on this data: a finding to
    review with the model owner, not a reason to lower the bar).
    """


@pytest.mark.max_neuron_pattern_deviation(0.05, layer="classifier.1", groups=10, where={"lighting": "night"})
def test_night_inputs_activate_the_usual_number_of_features(model, dataset):
    """At night, at most 5% of the inputs activate an unusual number of hidden units (outside the
    dominant group of activation counts and its neighbours, 10 groups over 64 units).

    A shifted activation pattern under one operating condition hints that the network sees those
    inputs differently. Measured: 0.000 (all 76 night inputs fall in the dominant group or next to it).
    """


@pytest.fixture(scope="session")
def operational_dataset():
    """The operational images with their labels (``digits_demo.profile.operational_dataset``)."""
    from digits_demo.profile import operational_dataset

    return operational_dataset()


@pytest.mark.max_pmi_ub(0.15, cells="balls", norm="linf", radius=0.05, clip=(0, 1), samples_per_cell=200,
                        bootstrap=100, data="operational_dataset")
def test_probability_of_misclassification_per_input(model, operational_profile, operational_dataset):
    """Upper bound (97.5%, sound Chernoff method) on the probability that the next operational
    input is misclassified (pmi, Zhao et al. 2021) is at most 15%.

    Cells are L-infinity balls of radius 0.05 (pixel range [0, 1]) around each of the 270 labelled
    operational images (empirical operational profile, 1/270 each); 200 uniform samples per ball,
    clipped to [0, 1]; a failure is any input in the ball that the model does not give the ball's
    label. The radius is below r-hat = 0.064 (half the smallest L-infinity distance between two
    operational images of different digits), so no ball can hold two digits, and every ball holds
    its own labelled centre (270 normal balls, no empty ball: no label comes from the model's own
    vote). Measured: E = 0.087, Ub = 0.124 (the model misclassifies 22 of the 270 operational
    images, 8.1%; the bound is above that error's 97.5% lower limit, 0.052, so the labelled data do
    not contradict it); 54,000 model queries, 8.7 s on 2 busy CPU cores.

    A 5% requirement is not met by this model: it is wrong on about 8% of operational inputs
    (22 of 270), and this gate says so if the threshold is lowered.
    """


def test_accuracy_under_operating_conditions(model, dataset):
    """Top-1 accuracy on the evaluation data, every image rendered under its operating scenario,
    is at least 90%.

    Requirement derived from the system-level error budget of the digit reader. Measured: 0.941
    (0.985 on the same images without conditions; 0.816 at night).
    """
    device = next(model.parameters(), torch.empty(0)).device
    loader = torch.utils.data.DataLoader(dataset, batch_size=256, shuffle=False)
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            pred = model(x.to(device)).argmax(dim=1).cpu()
            correct += (pred == y).sum().item()
            total += y.numel()
    assert total == len(dataset)
    accuracy = correct / total
    assert accuracy >= 0.90, f"accuracy {accuracy:.4f} ({correct}/{total}) below 0.90"


@pytest.mark.max_calibration_error(0.05, bins=15)
def test_confidence_is_calibrated(model, dataset):
    """The reader's softmax confidence is calibrated: expected calibration error (15 equal-width
    bins, Guo et al. 2017) on the evaluation data under its operating scenarios is at most 5%.

    A project gate (``digits_demo/calibration.py``, registered in ``tests/conftest.py``): the
    night-time monitor thresholds this confidence, so "95% sure" must mean right about 95% of the
    time. Measured: ECE 0.026 (accuracy 0.939, mean confidence 0.929; the 412 of 539 inputs with
    confidence above 0.93 are all right, the gap sits in the sparse bins between 0.27 and 0.93).
    """
