"""The device side of an engine: what every rank builds, and all a tensor-parallel worker is.

`Worker` loads the target (this rank's shard of it, sharding.py) and the drafter, sizes and
allocates the paged KV caches, holds the device state (device_state.py) and the `Executor`
(step.py) that runs a step's prefill forward and decode step, and captures the decode step's
CUDA graphs. The host side — requests, the scheduler, block bookkeeping, commit — is the
engine's (engine.py), on rank 0 only. A worker rank receives each step's `StateWrites` and
`StepPlan` from rank 0 and runs them here (distributed.py).

Invariants: every rank builds the same Worker from the same config (rank 0 decides the block
count every rank can hold); nothing here reads or changes a request.
"""
from __future__ import annotations

import os

import torch

from .config import EngineConfig, pick_device, pick_dtype
from .device_state import DeviceState
from .loader import load_model, resolve_model_dir
from .model import KVCache, ops_for
from .runner import ModelRunner
from .sharding import local_config
from .speculative import SpecStep
from .step import Executor
from .verify import VerifyMode


def _triton_interpreting() -> bool:
    import kernels  # noqa: F401  (sets TRITON_INTERPRET on CPU while it still can)
    return os.environ.get("TRITON_INTERPRET") == "1"


class Worker:
    def __init__(self, model_path, cfg: EngineConfig, parallel=None):
        self.config = cfg
        self.device = parallel.device if parallel is not None else pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self.model_dir = model_dir = resolve_model_dir(model_path)
        shard = {} if parallel is None else dict(layout=parallel.layout, tp=parallel.tp)
        self.model = load_model(model_dir, dtype=self.dtype, device=self.device, load_format=cfg.load_format,
                                seed=cfg.seed, **shard)
        self.model_config = mc = self.model.config
        # the attention of this rank (its own heads): what its KV cache holds
        self.kv_config = mc if parallel is None else local_config(mc, parallel.layout)
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        mc.check_max_model_len(self.max_model_len)      # dynamic RoPE: exact only up to max_position_embeddings
        self.backend = cfg.attention_backend
        if self.backend == "auto":
            self.backend = "triton" if self.device.type == "cuda" else "torch"
        if self.backend == "triton" and self.device.type != "cuda" and not _triton_interpreting():
            raise ValueError("attention_backend='triton' needs CUDA (or, for tests, TRITON_INTERPRET=1 "
                             "set before Triton is imported); use 'torch' on CPU")
        self.ops = ops_for(self.backend, cfg.batch_invariant)
        self.drafter = drafter = self._load_drafter()
        self.gamma = drafter.config.gamma if drafter is not None else 0
        if self.backend == "triton" or cfg.batch_invariant:    # one GEMM for q/k/v and for gate/up
            self.model.fuse()
            if drafter is not None:
                drafter.fuse()
        self.eplb = None                      # expert load balancing (eplb.py): widens the MoE layers
        if cfg.eplb:                          # before anything captures them
            from .eplb import ExpertBalancer
            self.eplb = ExpertBalancer(self.model, cfg, self.device)
        num_blocks = self._num_kv_blocks()
        if parallel is not None:              # the block count every rank can hold
            num_blocks = parallel.min_int(num_blocks)
        self.num_blocks = num_blocks
        self.kv_cache = KVCache(self.kv_config, {g: num_blocks for g in ("full", "sliding")}, cfg.block_size,
                                self.dtype, self.device)
        # the KV groups whose blocks the host allocates. The drafter's context cache is indexed by
        # the full-attention group's blocks (a position's context K/V sits in the block of its
        # target K/V): one allocation and one table serve both; a model with sliding layers only
        # gives the drafter a group of its own
        self.groups = list(self.kv_cache.groups)
        self.draft_group = None if drafter is None else "full" if "full" in self.groups else "draft"
        if self.draft_group == "draft":
            self.groups.append("draft")
        self.draft_cache = None
        if drafter is not None:
            dc = drafter.config
            self.draft_cache = torch.zeros(dc.num_layers, 2, num_blocks, cfg.block_size, dc.num_key_value_heads,
                                           dc.head_dim, dtype=self.dtype, device=self.device)
        decode_rows = 1 + self.gamma
        max_blocks = -(-(self.max_model_len + 2 * decode_rows) // cfg.block_size)
        self.state = DeviceState(cfg.max_num_seqs, self.groups, max_blocks, self.device)
        if self.draft_group is not None:
            self.state.tables["draft"] = self.state.tables[self.draft_group]    # the same tensor
        self.verify_mode = VerifyMode.parse(cfg.verify_mode)
        tp = parallel.tp if parallel is not None else None
        self.runner = ModelRunner(self.model, self.kv_cache, self.state, self.ops, cfg.block_size, drafter,
                                  self.draft_cache, tp=tp)
        spec = SpecStep(self.model, self.kv_cache, self.state, self.ops, cfg.block_size, self.verify_mode,
                        drafter, self.draft_cache, tp=tp)
        spec.coupled = cfg.coupled_sampling
        if cfg.synthetic_acceptance is not None:
            from .verify import SyntheticAcceptance
            spec.synthetic = SyntheticAcceptance.parse(cfg.synthetic_acceptance)
        use_graphs = cfg.cuda_graphs and self.device.type == "cuda" and self.backend == "triton"
        if use_graphs and cfg.cuda_graph_prefill and tp is None and self.eplb is None:
            self.runner.set_tiers(cfg.max_num_batched_tokens, graphs=True)   # EPLB would count padding rows
        self.executor = Executor(self.runner, spec, cfg.max_num_seqs, self.state.scratch, self.device, use_graphs,
                                 cfg.graph_batch_sizes, cfg.graph_token_fractions,
                                 cfg.verify_draft_fractions if cfg.verify_plain_steps else ())

    def capture(self, plain_steps: bool = False, shares=(), lapse: bool = False) -> None:
        """Tune the skinny GEMMs, then capture the decode step's graphs (CUDA only); with
        `plain_steps` also the plain step (one row per request; with `lapse` also the one that
        lets the drafter's context lapse) and the steps where only a share of the rows drafts (`shares`)."""
        if self.device.type == "cuda" and self.backend == "triton":
            self._tune_gemms()
        g = self.executor.graphs
        if g.use_graphs:
            g.capture([(True, False), (False, False)], progress=self.config.use_tqdm)
            for f, tiers in self.executor.draft_tiers.items():
                if plain_steps and (f == 0.0 or f in shares):
                    g.capture([(True, False, f), (False, False, f)], progress=self.config.use_tqdm, tiers=tiers)
                if plain_steps and lapse and f == 0.0:
                    g.capture([(True, False, f, False), (False, False, f, False)], progress=self.config.use_tqdm,
                              tiers=tiers)

    def _tune_gemms(self) -> None:
        """Record the GEMM shapes of every decode tier and let the skinny kernel take those it
        runs faster (kernels/linear.py); before capture, so the graphs hold the choice."""
        lin = self.ops.linear
        if not self.config.tune_gemm or not hasattr(lin, "tune"):
            return
        lin.recording = set()
        self.executor.graphs.warm([(True, False)])
        shapes, lin.recording = lin.recording, None
        lin.tune(shapes, self.device)

    def _load_drafter(self):
        """The drafter: `drafter_path`, else the model's `drafter/` if shipped. With dummy
        weights only its config.json is read, a model without a drafter gets DSpark's default one
        (`DrafterConfig.dspark_default`), and `gamma`, if set, is its block size; "none" turns
        speculation off either way."""
        import json
        from pathlib import Path
        from .drafter import Drafter, DrafterConfig
        path = self.config.drafter_path
        dummy = self.config.load_format == "dummy"
        if path is None:
            path = self.model_dir / "drafter"
            if not (path / "config.json").exists():
                path = None
                if not dummy:
                    return None
        elif str(path).lower() == "none":
            return None
        if dummy:
            if path is None:
                dcfg = DrafterConfig.dspark_default(self.model_config)
            else:
                if not (Path(path) / "config.json").exists():
                    raise FileNotFoundError(f"{path} has no config.json (a dummy drafter needs its config)")
                dcfg = DrafterConfig(**json.loads((Path(path) / "config.json").read_text()))
            if self.config.gamma:         # no trained block size to keep: draft the one asked for
                dcfg.gamma = self.config.gamma
            d = Drafter.random(dcfg, self.model, self.device, self.dtype, seed=self.config.seed + 1)
        else:
            d = Drafter.load(path, self.model, self.device, self.dtype)
        if self.config.gamma and self.config.gamma != d.config.gamma:
            raise ValueError(f"gamma={self.config.gamma} but the drafter was trained with block size "
                             f"{d.config.gamma}; serve with its own gamma (trim with verify_mode instead)")
        return d

    def _num_kv_blocks(self) -> int:
        cfg, mc, drafter = self.config, self.kv_config, self.drafter
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        n_layers = mc.num_hidden_layers + (drafter.config.num_layers if drafter is not None else 0)
        per_block = KVCache.bytes_per_block(mc, n_layers, cfg.block_size, self.dtype)
        if cfg.kv_cache_memory_gb:
            return max(1, int(cfg.kv_cache_memory_gb * 2**30 // per_block))
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(1, int(free * cfg.kv_memory_fraction // per_block))
        return cfg.cpu_kv_blocks
