"""A production-scale benchmark project for pytest-dnnsafety (issue #21).

ResNet-18-style and ViT-style classifiers written here (no downloads, no torchvision), structured
3x224x224 images with operating conditions generated into shards on disk and read through a
``DataLoader`` with workers, and a pytest run that takes every gate family to a verdict.
"""
