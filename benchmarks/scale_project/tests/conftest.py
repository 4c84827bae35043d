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
``certified_model``    the model of the certified gates: the CIFAR-stem ResNet (width 8) for images averaged down to
                       16x16, or the ``model`` itself with ``SCALE_CERTIFIED_SIZE=224``
``certified_data``     the first evaluation images at ``SCALE_CERTIFIED_SIZE`` (16 or 224):   ``SCALE_N_CERTIFIED`` 4
                       ``min_verified_robustness``
``radius_data``        likewise, for ``min_safe_radius``                                        ``SCALE_N_RADIUS`` 2
``monitor_data``       the training split: the runtime monitors are fitted on it                ``SCALE_N_FIT`` 1000
``pmi_data``           labelled operational images, streamed (``max_pmi_ub``'s r-separation and   ``SCALE_N_PMI`` 60
                       ball types); the operational profile is the plugin's, from
                       ``dnnsafety_operational_data`` (a DataLoader factory, or a ``.npy`` file)
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

from pytest_dnnsafety import Energy, Mahalanobis
from pytest_dnnsafety.engines.core.guard import probing
from scale_demo import project
from scale_demo.data import ShardImages, boxes_loader, loader, operational_loader

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
def certified_model(model):
    if project.certified_size() == 224:
        return model
    return _counted(project.resnet_small().to(_device(model)), "certified_model")


@pytest.fixture(scope="session")
def certified_data():
    return _loader("certified_data", stop=_env("SCALE_N_CERTIFIED", 4), size=project.certified_size(), batch_size=4)


@pytest.fixture(scope="session")
def radius_data():
    return _loader("radius_data", stop=_env("SCALE_N_RADIUS", 2), size=project.certified_size(), batch_size=2)


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


@pytest.fixture(scope="session")
def pmi_data():
    """The last training images with their labels, streamed: max_pmi_ub reads them in passes (the operational
    profile, from ``dnnsafety_operational_data``, holds the same images: scale_demo.data.operational_loader)."""
    data = operational_loader()
    SIZES["pmi_data"] = len(data.dataset)
    return data


def pytest_unconfigure(config):
    folder = os.environ.get("SCALE_RECORD")
    if folder:
        record = {"sizes": SIZES, "rows": ROWS}
        with open(os.path.join(folder, "record.json"), "w") as f:
            json.dump(record, f)
