"""What the cluster knows of its workers' vision model, from each one's WorkerInfo.vision.

    spec    where an image goes in a prompt (worker/image_prompt.py ImagePromptSpec): the router
            expands prompts with it, so every worker must place images exactly as the cluster
            does; a worker whose spec differs is refused like one that hashes blocks differently
    limits  what one request may send (worker/images.py ImageLimits): the smallest of each limit
            over the workers, so a request the router accepts is one every worker accepts

A worker without `vision` serves a text model: the cluster then has no vision and images are
refused. Imports no torch (the router imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.radixmesh.v1 import worker_pb2
from worker.image_prompt import ImagePromptSpec
from worker.images import ImageLimits


@dataclass(frozen=True)
class ModelVision:
    spec: ImagePromptSpec
    limits: ImageLimits

    @classmethod
    def of(cls, info: worker_pb2.WorkerInfo) -> ModelVision | None:
        """The worker's vision model (None: it serves a text model). Raises ValueError for a
        description no model could have (a zero limit, a zero run length)."""
        if not info.HasField("vision"):
            return None
        v = info.vision
        spec = ImagePromptSpec(
            image_token_id=v.image_token_id,
            image_seq_len=v.image_seq_len,
            tile_size=v.tile_size,
            longest_edge=v.longest_edge,
            do_image_splitting=v.do_image_splitting,
        )
        return cls(spec, ImageLimits(v.max_images, v.max_image_pixels, v.max_image_bytes))

    def smallest(self, other: ModelVision) -> ModelVision:
        """Each limit the smaller of the two (the specs are the same: `differs` said so)."""
        a, b = self.limits, other.limits
        limits = ImageLimits(
            min(a.max_images, b.max_images),
            min(a.max_pixels, b.max_pixels),
            min(a.max_bytes, b.max_bytes),
        )
        return ModelVision(self.spec, limits)

    @property
    def max_request_bytes(self) -> int:
        """The most image bytes one request may carry."""
        return self.limits.max_images * self.limits.max_bytes


def differs(cluster: ModelVision | None, worker: ModelVision | None) -> str | None:
    """Why a worker's vision model cannot join the cluster's (None: it can)."""
    if cluster is None and worker is None:
        return None
    if cluster is None or worker is None:
        theirs = "a vision model" if worker is not None else "a text model"
        ours = "a vision model" if cluster is not None else "a text model"
        return f"it serves {theirs}, the cluster {ours}"
    if cluster.spec != worker.spec:
        return f"it places images as {worker.spec}, the cluster as {cluster.spec}"
    return None
