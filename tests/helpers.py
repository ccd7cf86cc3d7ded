"""Helpers shared by the test modules (pytest puts this folder on sys.path)."""
import pyopencl.array as cla


def to_device(queue, *arrays):
    """A new device array on ``queue`` for each host array, in order."""
    return [cla.to_device(queue, a) for a in arrays]
