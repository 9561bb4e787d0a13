"""Any architecture's encoder behind one call, for the task heads (SPEC §4).

Every downstream task head (NLVR2, RefCOCO+, retrieval, VCR, phrase grounding) sits on the final
hidden states of a pre-trained encoder (`VLOutput`: text, vision, pooled, ViLBERT's h_IMG). `VLEncoder`
wraps the architecture's encoder module so that a head is written once for every architecture:

    enc = VLEncoder(cfg)                     # the arch's encoder (VisualBertModel, LxmertModel, ...)
    out = enc(inputs, tags=tags)             # VLOutput; tags only reach W-VisualBERT (§3.2)
    load_encoder_weights(enc, "runs/pt/model")   # from a pre-training or fine-tuned model directory

Pre-training and VQA/GQA checkpoints keep each architecture's encoder under its own name
(`ENCODER_PREFIX`: `bert.` for the single-stream models and ViLBERT, `lxmert.` for LXMERT); task models
built on `VLEncoder` hold it as `encoder.model.` (`TASK_PREFIX`). `load_encoder_weights` reads the
encoder of any of them and leaves every head behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from vlberts.data.batch import TagInputs, VLInputs
from vlberts.errors import VlbertsError
from vlberts.models.builders import arch_of, reads_tags
from vlberts.models.lxmert import LxmertModel
from vlberts.models.outputs import VLOutput
from vlberts.models.vilbert import ViLBertModel
from vlberts.models.visualbert import VisualBertModel
from vlberts.models.vlbert import VLBertModel
from vlberts.models.weights import find_weights, load_into, read_state_dict
from vlberts.models.wvisualbert import WVisualBertModel

ENCODERS: dict[str, type[nn.Module]] = {
    "visualbert": VisualBertModel,
    "lxmert": LxmertModel,
    "vilbert": ViLBertModel,
    "vlbert": VLBertModel,
    "wvisualbert": WVisualBertModel,
}

# the name each architecture's encoder has inside its pre-training and VQA models (and so in checkpoints)
ENCODER_PREFIX = {"visualbert": "bert", "lxmert": "lxmert", "vilbert": "bert", "vlbert": "bert", "wvisualbert": "bert"}


class VLEncoder(nn.Module):
    """The encoder of the config's architecture; `forward` returns its `VLOutput`."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg
        self.arch = arch_of(cfg)
        self.model = ENCODERS[self.arch](cfg)

    @property
    def reads_tags(self) -> bool:
        """Whether batches must carry detector tags (W-VisualBERT with tags on)."""
        return reads_tags(self.cfg)

    @property
    def hidden_size(self) -> int:
        """Width of `VLOutput.text` and `.pooled`."""
        return self.cfg.hidden_size

    @property
    def vision_size(self) -> int:
        """Width of `VLOutput.vision` (ViLBERT's visual stream has its own)."""
        return getattr(self.cfg, "v_hidden_size", self.cfg.hidden_size)

    def forward(self, x: VLInputs, tags: TagInputs | None = None, need_attn: bool = False) -> VLOutput:
        if self.arch == "wvisualbert":
            return self.model(x, tags, need_attn=need_attn)
        return self.model(x, need_attn=need_attn)

    def pooled(self, x: VLInputs, tags: TagInputs | None = None) -> Tensor:
        """`forward(x, tags).pooled` (B, D) alone, for the heads that read nothing else (NLVR2, VCR,
        retrieval). A single-stream encoder's pooler reads [CLS] alone, so its last layer computes that row
        alone (`Encoder.forward` rows): the same values for about a layer's worth less work. LXMERT's last
        cross-modality layer computes the language [CLS] alone and no vision (`LxmertModel.hidden`); ViLBERT
        runs whole. Each encoder model's own `pooled`; W-VisualBERT's also reads the tags, as in `forward`."""
        if self.arch == "wvisualbert":
            return self.model.pooled(x, tags)
        return self.model.pooled(x)


TASK_PREFIX = "encoder.model."  # a `VLEncoder` held as `encoder` by a task model


def load_encoder_weights(encoder: VLEncoder, directory: str | Path) -> dict[str, Tensor]:
    """Load the encoder of a vlberts model directory (pre-training, VQA/GQA or any `VLEncoder` task model)
    into `encoder`, strictly: every encoder weight must be there. Returns the directory's whole state dict, for
    a task head that starts from another of its tensors (e.g. `models.vlbert.start_from_roi_transform`)."""
    return load_encoder_module(encoder.model, encoder.arch, directory)


def load_encoder_module(module: nn.Module, arch: str, directory: str | Path) -> dict[str, Tensor]:
    """`load_encoder_weights` into `arch`'s bare encoder module (`ENCODERS[arch]`, e.g. the one a pre-training
    model holds under `ENCODER_PREFIX[arch]`); returns the state dict read."""
    weights = find_weights(directory)
    sd = read_state_dict(weights)
    load_encoder_state(module, arch, sd, weights)
    return sd


def load_encoder_state(module: nn.Module, arch: str, sd: dict[str, Tensor], weights: Path) -> None:
    """`load_encoder_module` from a state dict already read from `weights` (named in errors)."""
    for prefix in (ENCODER_PREFIX[arch] + ".", TASK_PREFIX):
        mine = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        if mine:
            names = {k[len(prefix):]: k for k in sd if k.startswith(prefix)}  # errors give the file's keys
            load_into(module, mine, source=weights, file_names=names)
            return
    raise VlbertsError(f"no {arch} encoder weights (keys {ENCODER_PREFIX[arch]}.* or {TASK_PREFIX}*) in the "
                       "weights file", path=weights)
