"""The MLP speculator (IBM, arXiv 2404.19124; vLLM's ``mlp_speculator`` format): small stages that guess the tokens
after ``t_0`` from the target's final hidden state ``h`` at the row that drew it.

    state_0   = h                  (with scale_input: h / rms(h) / sqrt(2))
    state_i+1 = GELU(LN_i(proj_i(state_i) + (emb_weight / state_weight) * emb_i(t_i)))
    t_i+1     = argmax head_i(state_i+1)                                   (i = 0 .. n_predict - 1)

    state_weight = 0.5 ** (0.5 / n_predict),  emb_weight = sqrt((1 - state_weight**2) * inner_dim / 2)
    LN(x)        = weight * x / sqrt(mean(x**2) + 1e-6) + bias

With ``tie_weights`` every stage shares stage 0's ``emb``, ``head`` and ``ln``, and stages 1.. share ``proj_1``.
A **hot vocabulary** (``hot_vocab_size: K``, ``hot_token_ids [K]``): ``head_i`` scores only those K tokens and
``emb_i`` has ``K + 1`` rows (row ``K`` embeds every other token).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from nanospec.model.config import check_tensors, checked_field
from nanospec.model.linear import pack_linears
from nanospec.model.loader import open_safetensors, read_json

ARCHITECTURE = "MLPSpeculatorPreTrainedModel"
LN_EPS = 1e-6


@dataclass
class MLPSpeculatorConfig:
    emb_dim: int
    inner_dim: int
    n_predict: int
    vocab_size: int
    tie_weights: bool = False
    scale_input: bool = False
    hot_vocab_size: int = 0  # nanospec: 0 scores the whole vocabulary

    @classmethod
    def from_dict(cls, config: dict, where: str) -> MLPSpeculatorConfig:
        archs = config.get("architectures")
        if archs != [ARCHITECTURE]:
            raise ValueError(f"{where}: architectures must be [{ARCHITECTURE!r}] for an MLP speculator, got {archs!r}")
        # name: (default when absent, minimum; None: true or false)
        fields = {"emb_dim": (None, 1), "inner_dim": (0, 0), "n_predict": (None, 1), "vocab_size": (None, 1),
                  "hot_vocab_size": (0, 0), "tie_weights": (False, None), "scale_input": (False, None)}
        values = {name: checked_field(where, name, config.get(name, default), minimum)
                  for name, (default, minimum) in fields.items()}
        values["inner_dim"] = values["inner_dim"] or values["emb_dim"]
        if values["tie_weights"] and values["n_predict"] < 2:
            raise ValueError(f"{where}: tie_weights needs n_predict >= 2, got {values['n_predict']}")
        if values["hot_vocab_size"] > values["vocab_size"]:
            raise ValueError(f"{where}: hot_vocab_size ({values['hot_vocab_size']}) exceeds vocab_size "
                             f"({values['vocab_size']})")
        return cls(**values)

    def to_dict(self) -> dict:
        config = {"architectures": [ARCHITECTURE], "model_type": "mlp_speculator", **asdict(self)}
        if not self.hot_vocab_size:
            del config["hot_vocab_size"]
        return config

    @property
    def num_scored(self) -> int:
        """Rows of each head: the hot vocabulary, or the whole one."""
        return self.hot_vocab_size or self.vocab_size


class SpeculatorNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps) + bias`` (no scale and shift: just the division)."""

    def __init__(self, dim: int, scale_and_shift: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if scale_and_shift else None
        self.bias = nn.Parameter(torch.zeros(dim)) if scale_and_shift else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + LN_EPS)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    """The stages as torch modules: :meth:`propose` for inference, :meth:`forward` (teacher-forced) to train."""

    def __init__(self, config: MLPSpeculatorConfig):
        super().__init__()
        self.config = c = config
        rows_in = c.hot_vocab_size + 1 if c.hot_vocab_size else c.vocab_size
        n = c.n_predict

        def stages(make) -> nn.ModuleList:  # with tie_weights, one module shared by every stage
            return nn.ModuleList([make()] * n if c.tie_weights else [make() for _ in range(n)])

        self.emb = stages(lambda: nn.Embedding(rows_in, c.inner_dim))
        self.head = stages(lambda: nn.Linear(c.inner_dim, c.num_scored, bias=False))
        self.ln = stages(lambda: SpeculatorNorm(c.inner_dim))
        if c.tie_weights:  # stages 1.. share proj_1
            proj_tied = nn.Linear(c.inner_dim, c.inner_dim, bias=False)
            self.proj = nn.ModuleList([nn.Linear(c.emb_dim, c.inner_dim, bias=False)] + [proj_tied] * (n - 1))
        else:
            self.proj = nn.ModuleList([nn.Linear(c.emb_dim if i == 0 else c.inner_dim, c.inner_dim, bias=False)
                                       for i in range(n)])
        self.input_norm = SpeculatorNorm(c.emb_dim, scale_and_shift=False) if c.scale_input else None
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * c.inner_dim / 2)
        # hot vocabulary: hot index -> token id, and token id -> hot index (K for a token outside the set)
        hot = torch.arange(c.num_scored)
        self.register_buffer("hot_token_ids", hot, persistent=False)
        self.register_buffer("hot_index", torch.arange(c.vocab_size), persistent=False)
        if c.hot_vocab_size:
            self.set_hot_vocabulary(hot)

    def set_hot_vocabulary(self, token_ids: torch.Tensor) -> None:
        c = self.config
        token_ids = token_ids.to(torch.int64).reshape(-1)
        if token_ids.numel() != c.num_scored or token_ids.unique().numel() != token_ids.numel() \
                or token_ids.min() < 0 or token_ids.max() >= c.vocab_size:
            raise ValueError(f"hot_token_ids must be {c.num_scored} distinct token ids in [0, {c.vocab_size})")
        device = self.hot_token_ids.device
        self.hot_token_ids = token_ids.to(device)
        index = torch.full((c.vocab_size,), c.num_scored if c.hot_vocab_size else 0, dtype=torch.int64)
        index[token_ids] = torch.arange(token_ids.numel())
        self.hot_index = index.to(device)

    def first_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """state_0 from the target's final hidden state."""
        return self.input_norm(hidden) / math.sqrt(2) if self.input_norm is not None else hidden

    def stage(self, i: int, state: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(state_i+1, logits_i over the scored tokens) from state_i ``[..., dim]`` and token ids ``[...]``."""
        z = self.emb[i](self.hot_index[token_ids])
        state = self.proj[i](state) + (self.emb_weight / self.state_weight) * z
        state = F.gelu(self.ln[i](state))
        return state, self.head[i](state)

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy guesses ``[B, k]`` after ``token_ids [B]`` from ``hidden [B, emb_dim]``: a beam of width 1."""
        return self.propose_tree(hidden, token_ids, k, 1)[0]

    @torch.inference_mode()
    def propose_tree(self, hidden: torch.Tensor, token_ids: torch.Tensor, k: int, width: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A beam search over the stages: depth ``d`` keeps the ``width`` most probable paths of ``d`` tokens (score:
        summed log-probabilities), each extending a path of depth ``d - 1`` by one of its stage's ``width`` best
        tokens. Returns ``(token_ids, parents, log_probs)``, each ``[B, k * width]``: node ``d * width + j`` is the
        ``j``-th best path of ``d + 1`` tokens, under node ``parents[:, node]`` (-1: the root); siblings hold distinct
        tokens."""
        if not 0 <= k <= self.config.n_predict:
            raise ValueError(f"this speculator guesses at most {self.config.n_predict} tokens, asked for {k}")
        if not 1 <= width <= self.config.num_scored:
            raise ValueError(f"the beam width must be in [1, {self.config.num_scored}], got {width}")
        batch = token_ids.shape[0]
        state = self.first_state(hidden.to(self.proj[0].weight.dtype))[:, None]  # [B, paths, dim]
        tokens, scores = token_ids[:, None], hidden.new_zeros(batch, 1, dtype=torch.float32)
        all_tokens, all_parents, all_scores = [], [], []
        for i in range(k):
            state, logits = self.stage(i, state, tokens)  # each path's next state, and its next token's logits
            top_logp, top_index = logits.float().log_softmax(-1).topk(width, -1)  # [B, paths, width]
            scores, pick = (scores[..., None] + top_logp).flatten(1).topk(width, -1)  # the best paths one longer
            parent = torch.div(pick, width, rounding_mode="floor")  # which path each extends
            tokens = self.hot_token_ids[top_index.flatten(1).gather(1, pick)]
            state = state.gather(1, parent[..., None].expand(-1, -1, state.shape[-1]))
            all_tokens.append(tokens)
            all_parents.append(parent + (i - 1) * width if i else torch.full_like(parent, -1))
            all_scores.append(scores)
        if not all_tokens:
            empty = token_ids.new_zeros(batch, 0)
            return empty, empty, scores[:, :0]
        return torch.cat(all_tokens, 1), torch.cat(all_parents, 1), torch.cat(all_scores, 1)

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced logits of every stage: ``hidden [N, emb_dim]`` at t, ``token_ids [N, n_predict]`` the tokens
        at t+1 ..; n_predict tensors ``[N, num_scored]``."""
        state, out = self.first_state(hidden), []
        for i in range(self.config.n_predict):
            state, logits = self.stage(i, state, token_ids[:, i])
            out.append(logits)
        return out

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of the format, each shared one once (stage 0's, and proj.1 when tied)."""
        c = self.config
        tensors = {}
        for i in [0] if c.tie_weights else range(c.n_predict):
            tensors |= {f"emb.{i}.weight": self.emb[i].weight, f"head.{i}.weight": self.head[i].weight,
                        f"ln.{i}.weight": self.ln[i].weight, f"ln.{i}.bias": self.ln[i].bias}
        for i in [0, 1] if c.tie_weights else range(c.n_predict):
            tensors[f"proj.{i}.weight"] = self.proj[i].weight
        if c.hot_vocab_size:
            tensors["hot_token_ids"] = self.hot_token_ids
        return tensors


def save_mlp_speculator(model: MLPSpeculator, directory: str | os.PathLike, dtype: torch.dtype = torch.float16,
                        metadata: dict | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (floats in ``dtype``) to ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous().cpu()
               for name, t in model.stored_tensors().items()}
    save_file(tensors, str(directory / "model.safetensors"),
              metadata={k: str(v) for k, v in (metadata or {}).items()})
    return directory


def load_mlp_speculator(path: str | os.PathLike, emb_dim: int | None = None, vocab_size: int | None = None,
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> MLPSpeculator:
    """Load a speculator directory for inference (its linears packed, :func:`~nanospec.model.linear.pack_linears`);
    ``emb_dim`` / ``vocab_size``: the target's, checked when given."""
    directory = Path(path)
    config_file = directory / "config.json"
    if not directory.is_dir():
        raise FileNotFoundError(f"MLP speculator path is not a directory: {directory}")
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} has no config.json (an MLP speculator directory holds config.json "
                                f"and model.safetensors)")
    config = MLPSpeculatorConfig.from_dict(read_json(config_file), str(config_file))
    if emb_dim is not None and config.emb_dim != emb_dim:
        raise ValueError(f"{config_file}: emb_dim {config.emb_dim} does not match the target's hidden size {emb_dim}")
    if vocab_size is not None and config.vocab_size != vocab_size:
        raise ValueError(f"{config_file}: vocab_size {config.vocab_size} does not match the target's vocabulary "
                         f"({vocab_size})")
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{directory} has no model.safetensors (only safetensors weights are loaded)")
    model = MLPSpeculator(config)
    expected = {name: tuple(t.shape) for name, t in model.stored_tensors().items()}
    handle = open_safetensors(weights)
    stored = {name.removeprefix("speculator."): name for name in handle.keys()}
    check_tensors(weights, expected, {name: handle.get_slice(stored[name]).get_shape() for name in stored},
                  "config.json", strict=False)
    tensors = {}
    for name in expected:
        try:
            tensor = handle.get_tensor(stored[name])
        except Exception as error:
            raise ValueError(f"cannot read tensor {stored[name]} of {weights} ({error})") from None
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"tensor {stored[name]} in {weights} holds NaN or infinite values")
        tensors[name] = tensor
    with torch.no_grad():
        if config.hot_vocab_size:
            model.set_hot_vocabulary(tensors.pop("hot_token_ids"))
        own = model.stored_tensors()
        for name, tensor in tensors.items():
            own[name].copy_(tensor.to(own[name].dtype))
    return pack_linears(model.to(device=device, dtype=dtype).eval().requires_grad_(False))
