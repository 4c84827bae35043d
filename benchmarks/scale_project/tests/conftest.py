"""Fixtures of the scale_demo project: everything the gates read streams from the shards on disk.

Every data fixture is a ``DataLoader`` (two workers, in order) over :class:`scale_demo.data.ShardImages`,
which memory-maps a shard and converts one image at a time: no fixture holds the evaluation data.

=====================  =======================================================================  ================
fixture                what                                                                     images (default)
=====================  =======================================================================  ================
``dataset``            the evaluation split, 3x224x224 (overrides the plugin's, which loads      all (``--n``)
                       ``dnnsafety_data`` whole)
``model``              ``dnnsafety_model``: the ResNet-18-style model, width ``SCALE_WIDTH``
``vit_model``          the ViT-style model (patch 16, dim 64, depth 2)
``attack_data``        the first evaluation images: adversarial gates                           ``SCALE_N_ATTACK`` 500
``occlusion_data``     the first evaluation images, and ``occlusion_masks`` theirs              ``SCALE_N_OCCLUSION`` 200
``small_data``         the first evaluation images averaged down to 16x16, for ``small_model``   ``SCALE_N_CERTIFIED`` 4
                       (the CIFAR-stem ResNet): ``min_verified_robustness``
``radius_data``        likewise, for ``min_safe_radius`` (its search polls every input           ``SCALE_N_RADIUS`` 2
                       dimension)
``monitor_data``       the training split: the runtime monitors are fitted on it                ``SCALE_N_FIT`` 1000
``pmi_data``           labelled operational images, streamed (``max_pmi_ub`` puts a ball         ``SCALE_N_PMI`` 60
                       around each), and ``operational_profile`` (PCA-2 latent KDE) of them
``detector``           the one-object detector (the ResNet-18-style backbone with a class and a box head)
``detection_data``     the evaluation split as detection data (:class:`scale_demo.data.ShardBoxes`:  all (``--n``)
                       each image's object and its mask's tight box), ``detection_collate``
``scenario_table``     ``dnnsafety_scenarios`` + ``dnnsafety_conditions`` (one row per image)
=====================  =======================================================================  ================

With ``SCALE_RECORD`` set, the run writes there the images each data fixture holds and the rows each
model forwarded (the benchmark runner reads it).
"""

import json
import os

import pytest
import torch

from pytest_dnnsafety import Energy, Mahalanobis, OperationalProfile
from pytest_dnnsafety.engines.core.guard import probing
from pytest_dnnsafety.engines.reliability.profile import PCA
from scale_demo import project
from scale_demo.data import ShardImages, boxes_loader, loader

BATCH = 64
SIZES: dict[str, int] = {}
ROWS: dict[str, int] = {}


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _device(model):
    """The ``model``'s device (``dnnsafety_device``): the project's other models go there too."""
    return next(model.parameters()).device


def _split(name: str):
    return project.data_dir() / name


def _loader(tag: str, split: str = "eval", stop: int | None = None, size: int = 224, batch_size: int = BATCH):
    data = loader(_split(split), 0, stop, size, batch_size=batch_size)
    SIZES[tag] = len(data.dataset)
    return data


def _counted(net, tag):
    """``net`` counting the rows it forwards (the plugin's determinism probe excepted)."""
    ROWS.setdefault(tag, 0)

    def count(module, args):
        if not probing():
            ROWS[tag] += int(args[0].shape[0])

    net.register_forward_pre_hook(count)
    return net


@pytest.fixture(scope="session")
def dataset():
    return _loader("dataset")


@pytest.fixture(scope="session")
def model(model):
    """The plugin's ``model`` (``dnnsafety_model``, on ``dnnsafety_device``), its forwarded rows counted."""
    return _counted(model, "model")


@pytest.fixture(scope="session")
def vit_model(model):
    return _counted(project.vit_model().to(_device(model)), "vit_model")


@pytest.fixture(scope="session")
def detector(model):
    return _counted(project.detector().to(_device(model)), "detector")


@pytest.fixture(scope="session")
def detection_data():
    data = boxes_loader(_split("eval"), batch_size=BATCH)
    SIZES["detection_data"] = len(data.dataset)
    return data


@pytest.fixture(scope="session")
def attack_data():
    return _loader("attack_data", stop=_env("SCALE_N_ATTACK", 500))


@pytest.fixture(scope="session")
def occlusion_data():
    return _loader("occlusion_data", stop=_env("SCALE_N_OCCLUSION", 200))


@pytest.fixture(scope="session")
def occlusion_masks():
    """The objects' segmentation masks of ``occlusion_data`` (bool, 224x224), written with the images."""
    return ShardImages(_split("eval"), 0, _env("SCALE_N_OCCLUSION", 200)).masks()


@pytest.fixture(scope="session")
def small_model(model):
    return _counted(project.resnet_small().to(_device(model)), "small_model")


@pytest.fixture(scope="session")
def small_data():
    return _loader("small_data", stop=_env("SCALE_N_CERTIFIED", 4), size=project.SMALL, batch_size=4)


@pytest.fixture(scope="session")
def radius_data():
    return _loader("radius_data", stop=_env("SCALE_N_RADIUS", 2), size=project.SMALL, batch_size=2)


@pytest.fixture(scope="session")
def monitor_data():
    return _loader("monitor_data", split="train", stop=_env("SCALE_N_FIT", 1000))


@pytest.fixture(scope="session")
def monitors():
    """Energy on the logits; Mahalanobis on the pooled features before the head (64 at width 8)."""
    return {"energy": Energy(), "maha": Mahalanobis(layer="flatten")}


@pytest.fixture(scope="session")
def severity_matrix():
    """Confusing two shapes costs 1; a solid shape for a textured one (or back) costs 2: a texture is what a
    downstream classifier keys on (classes 6-8 are textured squares/disks, 4 a ring)."""
    textured = torch.zeros(10, dtype=torch.bool)
    textured[[4, 6, 7, 8]] = True
    w = torch.ones(10, 10, dtype=torch.float64) + (textured[:, None] != textured[None, :]).double()
    w.fill_diagonal_(0.0)
    return w


def _operational():
    """The last images of the training split, held: the grid-cell profile's KDE (PCA latent space) needs them."""
    data = ShardImages(_split("train"))
    n = _env("SCALE_N_PMI", 60)
    rows = range(len(data) - n, len(data))
    x = torch.stack([data[i][0] for i in rows])
    return x, torch.tensor([data[i][1] for i in rows])


@pytest.fixture(scope="session")
def pmi_data():
    """The last training images as a streamed loader: max_pmi_ub's ball cells read centres and labels in passes."""
    split = _split("train")
    n_train = len(ShardImages(split))
    data = loader(split, n_train - _env("SCALE_N_PMI", 60), n_train, 224, batch_size=BATCH)
    SIZES["pmi_data"] = len(data.dataset)
    return data


@pytest.fixture(scope="session")
def operational_profile():
    x, _ = _operational()
    pca = PCA(2).fit(x)
    return OperationalProfile(x, encoder=pca.encode, decoder=lambda z: pca.decode(z).clamp(0, 1).float())


def pytest_unconfigure(config):
    folder = os.environ.get("SCALE_RECORD")
    if folder:
        record = {"sizes": SIZES, "rows": ROWS}
        with open(os.path.join(folder, "record.json"), "w") as f:
            json.dump(record, f)
