"""Typed configuration: one dataclass per step, one top-level `Config`, YAML that mirrors it.

    cfg = load("configs/quickstart.yaml", ["train.lr=3e-4", "run_dir=/tmp/x"])

This module is the schema (the dataclasses below) and the entry points callers use: `load`,
`where`, `dump`, `fingerprint`, `to_dict`, `help_lines`, `keys`. Every field has a default and a
one-line doc (`doc(...)` below) that `drafter <cmd> --help` prints: the keys users set
(`doc(..., user=True)`), or every key with `--help all`. Unknown keys, wrong types and values
out of range raise `ConfigError` naming the dotted key, the file and the line; the machinery
that finds them (YAML line table, type coercion, dotted overrides, ranges and cross-field rules)
is drafter/core/configload.py. Derived values (layer ids, drafter shape) are computed once by
the step that needs them and recorded in its manifest, never configured twice.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from drafter import not_utf8
from drafter.core.configload import (
    ConfigError,
    Where,
    apply_override,
    build,
    check_values,
    derive,
    parse_override,
    retire,
)


def doc(default: Any, help: str, user: bool = False, **kw) -> Any:
    """A dataclass field with a default and the one-line doc shown by --help. `user`: a key
    users set (the shipped configs, the docs' examples), listed by the default `--help`; the
    others only by `--help all`."""
    meta = {"help": help, "user": user}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda d=default: _copy(d), metadata=meta, **kw)
    if callable(default) and isinstance(default, type):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _copy(x):
    import copy
    return copy.deepcopy(x)


# ------------------------------------------------------------------------------------------- target
@dataclass
class TargetConfig:
    model: str = doc("builtin:smollm2-135m-instruct",
                     "HF model id, local HF folder, .gguf file, or builtin:smollm2-135m-instruct",
                     user=True)
    revision: str | None = doc(None, "HF hub revision (branch, tag or commit) for a model id")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = doc(
        "auto", "target weights dtype; auto = bfloat16 on GPU, float32 on CPU", user=True)
    device: str = doc("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    trust_remote_code: bool = doc(False, "allow the model repo's own Python code (off: security)",
                                  user=True)
    chat_template: str | None = doc(None, "path to a Jinja chat template overriding the "
                                    "tokenizer's")
    engine_args: dict[str, Any] = doc(
        {}, "vLLM's own LLM(...) arguments where a step runs the target inside vLLM "
        "(extract.engine / evaluate.engine): tensor_parallel_size, enable_expert_parallel, "
        "quantization, gpu_memory_utilization, max_model_len... (docs/extract.md)", user=True)


# ------------------------------------------------------------------------------------------ prepare
@dataclass
class SyntheticConfig:
    count: int = doc(1000, "conversations to make", user=True)
    turns: int = doc(1, "user turns per conversation; later ones are written after the answers")
    system_prompts: list[str] = doc([], "steering: one drawn per conversation (seeded)")
    topics: list[str] = doc([], "steering: one drawn per conversation into the system prompt "
                            "'The user asks about {topic}.'")
    temperature: float = doc(1.0, "sampling temperature of the user turns")
    max_tokens: int = doc(256, "token cap of a user turn; a turn that reaches it is rejected")
    min_chars: int = doc(16, "shortest user turn kept (characters)")
    max_chars: int = doc(2000, "longest user turn kept (characters)")
    near_dup: float = doc(0.8, "first user turns at MinHash Jaccard >= this to a kept one are "
                          "rejected; 1 keeps near duplicates (exact ones are always rejected)")
    max_attempts: int = doc(4, "user turns sampled per conversation turn before it is an error")


@dataclass
class SourceConfig:
    path: str = doc("", "JSON/JSONL(.gz)/Parquet file, HF dataset name or folder, or builtin:NAME",
                    user=True)
    format: Literal["auto", "sharegpt", "openai", "alpaca", "prompt"] = doc(
        "auto", "record format; auto detects it from the fields of the first records")
    field: str | None = doc(None, "the record field to read where the format reads its prompt "
                            "(e.g. Instruction): the prompt text or turns, the messages "
                            "(openai), the conversation (sharegpt) or the instruction (alpaca)")
    split: str = doc("train", "split of a HF dataset", user=True)
    subset: str | None = doc(None, "config name of a HF dataset")
    max_samples: int | None = doc(None, "keep at most this many records from this source",
                                  user=True)
    name: str | None = doc(None, "name in record ids and counts; default: the file stem", user=True)
    synthetic: SyntheticConfig | None = doc(
        None, "set to make this source synthetic: the target writes the user turns itself "
        "(pre-query template; path unused; generate.server.engine drafter)")


@dataclass
class PrepareConfig:
    sources: list[SourceConfig] = doc(
        [SourceConfig(path="builtin:quickstart-prompts")], "where the conversations come from")
    shuffle: bool = doc(True, "shuffle records (seeded) before max_samples, dedup and the split")
    seed: int = doc(0, "seed of the shuffle and of the train/validation split")
    dedup: bool = doc(True, "drop exact duplicates of the normalised first user turn")
    val_fraction: float = doc(0.05, "share of conversations held out for validation", user=True)
    max_bad_fraction: float = doc(0.01, "fail when more than this share of records is malformed")
    require_assistant: bool = doc(False, "reject conversations without an assistant turn "
                                  "(needed when generate.enabled is false)")


# ----------------------------------------------------------------------------------------- generate
@dataclass
class ServerConfig:
    engine: Literal["transformers", "vllm", "sglang", "external", "drafter"] = doc(
        "transformers", "who answers: a server drafter starts (transformers serve, vllm, "
        "sglang), external URLs, or drafter (its own data engine, in this process)", user=True)
    urls: list[str] = doc([], "OpenAI-compatible base URLs for engine=external (load-balanced)",
                          user=True)
    host: str = doc("127.0.0.1", "bind address of a server drafter starts")
    allow_remote: bool = doc(False, "let a server drafter starts listen on a host other than "
                             "localhost (anyone who reaches it can use the model)")
    port: int = doc(0, "port of a server drafter starts; 0 picks a free one")
    command: str | None = doc(None, "command template overriding the engine's default "
                              "({model}, {host}, {port} are filled in)")
    extra_args: list[str] = doc([], "extra arguments appended to the server command", user=True)
    startup_timeout: float = doc(900.0, "seconds to wait for the server to become healthy")
    api_key_env: str = doc("OPENAI_API_KEY", "environment variable holding the API key, if any")
    model_name: str | None = doc(None, "model name sent in requests; default: the started "
                                 "model, else the first of GET /v1/models")
    max_restarts: int = doc(3, "restarts of a server drafter started, when it dies mid-run")
    stop_timeout: float = doc(30.0, "seconds between SIGTERM and SIGKILL when stopping a server")
    replicas: int = doc(1, "servers drafter starts, each on its share of the visible GPUs, "
                        "load-balanced (e.g. 8 transformers servers on 8 GPUs)")


@dataclass
class GenerateConfig:
    enabled: bool = doc(True, "regenerate answers with the target; false trains on the data's own",
                        user=True)
    server: ServerConfig = doc(ServerConfig(), "the generation server")
    concurrency: int = doc(16, "requests in flight per server", user=True)
    temperature: float = doc(0.0, "sampling temperature", user=True)
    extra_temperatures: list[float] | Literal["evaluate"] = doc(
        [], "answer every conversation again at each of these temperatures (id ID@tT): [0.8] "
        "beside greedy answers trains on sampled contexts too; evaluate: at each of "
        "evaluate.temperatures, the ones you serve (docs/generate.md)", user=True)
    top_p: float = doc(1.0, "nucleus sampling threshold")
    max_tokens: int = doc(512, "max new tokens per answer", user=True)
    seed: int = doc(0, "sampling seed sent with each request")
    max_retries: int = doc(5, "retries with exponential backoff before a request is an error")
    retry_backoff: float = doc(1.0, "first retry delay in seconds; doubles each retry (max 60)")
    request_timeout: float = doc(600.0, "seconds before one request times out")
    drop_truncated: bool = doc(False, "drop answers cut by max_tokens (finish_reason=length)")
    chat_template_kwargs: dict[str, Any] = doc(
        {}, "sent with each request, e.g. {enable_thinking: true}; keep it equal to what "
        "tokenize renders with", user=True)
    batch_size: int = doc(1024, "engine=drafter: rows decoded together per GPU; memory is "
                          "planned, so a large value waits for KV pages, never runs out", user=True)


# ----------------------------------------------------------------------------------------- tokenize
@dataclass
class TokenizeConfig:
    max_length: int = doc(2048, "max tokens per conversation", user=True)
    overflow: Literal["truncate", "drop"] = doc("truncate", "what to do past max_length")
    drop_truncated: bool = doc(False, "skip conversations with an answer cut at "
                               "generate.max_tokens (they are kept on disk: no regeneration)")
    max_loop_tokens: int | None = doc(64, "cut a conversation inside an answer after this "
                                      "many tokens of a repetition loop (a 16-token window "
                                      "seen earlier in the answer); None keeps loops whole. "
                                      "64: tau +4% at equal steps on SmolLM2 (BENCHMARKS.md)")
    loop_copies: int = doc(3, "a passage's copy from which its tokens count as a loop (3: said "
                           "twice is not a loop, e.g. code restated after a fix)")
    enable_thinking: bool | None = doc(None, "passed to chat templates that take it (Qwen3)",
                                       user=True)
    template_kwargs: dict[str, Any] = doc(
        {}, "more variables for the chat template, e.g. {thinking: true} (DeepSeek-V3.1)",
        user=True)
    batch_size: int = doc(256, "conversations rendered and tokenized per batch")
    workers: int = doc(0, "processes rendering and tokenizing; 0 = auto (up to 32), 1 = in-process")


# -------------------------------------------------------------------------------------------- vocab
@dataclass
class VocabConfig:
    draft_vocab_size: int = doc(32000, "draft vocab size (capped at the target vocab size)",
                                user=True)


# ------------------------------------------------------------------------------------------ extract
@dataclass
class ExtractConfig:
    engine: Literal["drafter", "vllm"] = doc(
        "drafter", "where the target runs: drafter (its own capture in this process: the target "
        "in transformers with hooks; a target that fits one GPU, or extract.tp), or vllm (its "
        "extract_hidden_states method: the engine's tensor/expert parallelism and quantised "
        "weights, target.engine_args)", user=True)
    layer_ids: list[int] | None = doc(None, "aux layer ids, HS[k] convention, ascending and "
                                      "distinct; default [2, N//2, N-3] (three distinct "
                                      "layers below 8 layers)", user=True)
    aux_dtype: Literal["bf16", "fp8"] = doc("bf16", "storage of aux states: bf16, or fp8-e4m3 "
                                            "with a per-token scale", user=True)
    teacher: Literal["hidden", "topk"] = doc("hidden", "teacher signal: final hidden state, or "
                                             "top-k log-probs within the draft vocab", user=True)
    topk: int = doc(64, "k for teacher=topk", user=True)
    batch_tokens: int = doc(16384, "tokens per prefill batch (sorted by length)", user=True)
    shard_tokens: int = doc(65536, "tokens per shard file (a shard is held in memory while it "
                            "is written: Ht=7168 bf16+hidden is 3.8 GB)")
    tp: bool = doc(False, "tensor-parallel target (transformers tp_plan) under torchrun")
    preflight: Literal["refuse", "warn", "off"] = doc(
        "refuse", "when GPU memory is held by other processes: refuse, warn, or skip the check")
    spool: str | None = doc(
        None, "with max_disk_gib: the folder the chunks go through, one both machines reach "
        "when `drafter extract` fills it and `drafter train` elsewhere empties it; null: "
        "RUN_DIR/chunks")
    precompile: bool = doc(True, "GPU: compile train's graphs (torch.compile) in a process of "
                           "its own while the target runs (online: from tokenize until train's "
                           "first step), when memory allows: train's warm-up then reads "
                           "Inductor's cache (drafter/train/precompile.py)")


# -------------------------------------------------------------------------------------------- train
@dataclass
class LossTermConfig:
    kind: Literal["kl", "ce", "tv", "nla", "lk"] = doc("kl", "the term (docs/train.md, The loss)")
    weight: float = doc(1.0, "its weight in the sum")
    temperature: float | None = doc(None, "serving temperature it compares at; default 1, ce 0")
    eta: float = doc(3.0, "lk: the KL share is exp(-eta x acceptance)")


@dataclass
class BlockDrafterConfig:
    block_size: int = doc(8, "tokens a block drafts (vLLM's num_speculative_tokens)", user=True)
    layers: int = doc(5, "draft layers of the parallel backbone")
    target_layers: int = doc(5, "target layers read when extract.layer_ids is unset (spread "
                             "from the second to the fourth-last)")
    markov_rank: int = doc(64, "dspark: rank r of the Markov head (the previous token's bias "
                           "on each draft)")
    confidence_head: bool = doc(True, "dspark: the per-draft acceptance head adaptive "
                                "verification reads")
    anchors: int = doc(256, "blocks trained per packed row (anchors drawn along it)")
    mask_token_id: int | None = doc(None, "the token whose (frozen) embedding fills a block's "
                                    "masked queries; default: the target vocab's last id")


@dataclass
class TrainConfig:
    method: Literal["eagle3", "dflash", "dspark"] = doc(
        "eagle3", "the drafter kind: eagle3 (one layer, drafts token by token), or the "
        "parallel block drafters dflash and dspark (a block of train.dspark.block_size tokens "
        "in one forward; dspark adds a Markov and a confidence head): docs/train.md", user=True)
    dspark: BlockDrafterConfig = doc(BlockDrafterConfig(), "the block drafters' shape (dflash "
                                     "reads block_size, layers, target_layers, anchors, "
                                     "mask_token_id)")
    online: bool = doc(False, "run the target beside the drafter; store no hidden states",
                       user=True)
    online_group: int = doc(4, "online: micro-batches whose samples one call of the target "
                            "captures (forwards grouped by length across them: fewer, fuller); "
                            "the features of about 3x this many micro-batches sit on the GPU")
    ttt_steps: int = doc(7, "training-time-test unroll length", user=True)
    ttt_decay: float = doc(0.8, "loss weight decay per TTT step (weight 0.8**i)")
    loss: list[LossTermConfig] | None = doc(
        None, "terms summed by weight, e.g. [{kind: kl, weight: 0.1}, {kind: tv, weight: 0.9}]; "
        "null: [{kind: kl}] for eagle3, that example for dflash, dspark (docs/train.md)")
    position_weight: Literal["decay", "dpace"] = doc(
        "decay", "step i's weight: ttt_decay**i, or dpace (from the rows' acceptance)")
    dpace_alpha: float = doc(0.5, "dpace: step acceptance a smoothed to (1 - alpha)·a + alpha")
    noise: float = doc(0.0, "Gaussian noise on the aux states while training, x their RMS")
    optimizer: Literal["adamw", "muon"] = doc(
        "adamw", "adamw, or muon (torch.optim.Muon on 2-D weights, AdamW on the rest, lm_head)")
    muon_lr: float | None = doc(None, "muon: the Muon matrices' peak lr; default train.lr")
    intermediate_size: int | None = doc(None, "drafter MLP size; default: the target's")
    norm_before_residual: bool = doc(False, "norm h before the residual (SGLang supports only "
                                     "false)")
    fc_norm: bool = doc(False, "EAGLE-3.1: RMSNorm each aux state before fc")
    norm_output: bool = doc(False, "EAGLE-3.1: feed back the post-norm state in TTT")
    draft_layer: Literal["auto", "llama", "mla"] = doc(
        "auto", "the draft layer's attention: llama, or mla (DeepSeek's latent attention, "
        "served by vLLM and SGLang, not llama.cpp); auto: mla for MLA targets (docs/train.md)")
    mla: dict[str, Any] = doc(
        {}, "mla draft layer sizes over the target's: q_lora_rank, kv_lora_rank, "
        "qk_nope_head_dim, qk_rope_head_dim, v_head_dim")
    attention: Literal["auto", "sdpa", "flex"] = doc(
        "auto", "train attention: sdpa (exact, CPU/GPU) or flex (fast GPU); auto: flex "
        "on a GPU for eagle3, else sdpa")
    compile: bool = doc(True, "torch.compile the fast path's layer and loss pieces (GPU only)")
    loss_chunk: int = doc(0, "fast path: rows of each chunk that lm_head and the loss run on "
                          "at a time; 0 sizes them so that a chunk's float32 logits take 256 "
                          "MiB (2,097 rows at a 32,000-token draft vocab). Larger chunks: "
                          "fewer compiled calls a step, more memory")
    lr: float = doc(1.2e-3, "peak learning rate (AdamW); 1.2e-3: tau +5% over 6e-4 at 250 "
                    "steps on SmolLM2 (BENCHMARKS.md)", user=True)
    min_lr_ratio: float = doc(0.0, "final lr as a share of the peak (cosine)")
    warmup_ratio: float = doc(0.02, "share of steps spent in linear warmup", user=True)
    weight_decay: float = doc(0.0, "AdamW weight decay")
    grad_clip: float = doc(0.5, "max grad norm")
    epochs: int = doc(2, "passes over the training data (2: the best measured SmolLM2 drafter)",
                      user=True)
    max_steps: int | None = doc(None, "stop after this many optimizer steps", user=True)
    batch_tokens: int = doc(16384, "tokens per micro-batch per rank (packed)", user=True)
    max_length: int = doc(2048, "max tokens per packed sequence", user=True)
    grad_accum: int = doc(1, "micro-batches per optimizer step")
    dtype: Literal["auto", "bfloat16", "float32"] = doc(
        "auto", "autocast dtype; auto = bfloat16 on GPU, float32 on CPU")
    fsdp: bool = doc(False, "shard the drafter with FSDP2 under torchrun instead of DDP", user=True)
    seed: int = doc(0, "seed of init, data order and dropout")
    log_every: int = doc(10, "optimizer steps between log lines")
    eval_every: int = doc(200, "optimizer steps between validation passes (0: only at "
                          "checkpoints and the end)", user=True)
    eval_batches: int | None = doc(None, "cap on validation micro-batches per pass "
                                   "(None: the whole split)")
    save_every: int = doc(500, "optimizer steps between checkpoints", user=True)
    keep_checkpoints: int = doc(2, "checkpoints kept (the best one is always kept)")
    resume: str | bool = doc("auto", "auto (latest checkpoint), a checkpoint path, or off "
                             "(YAML reads a bare off as false: both mean off)", user=True)
    tensorboard: bool = doc(False, "also write TensorBoard events")


# ------------------------------------------------------------------------------------------- export
@dataclass
class ExportConfig:
    checkpoint: str = doc("last", "last, best (validation simulated tau), or a checkpoint path",
                          user=True)
    max_position_embeddings: int | None = doc(None, "serving context; default: the target's")
    speculative_tokens: int = doc(3, "K written into the speculators config", user=True)
    dtype: Literal["bfloat16", "float16", "float32"] = doc(
        "bfloat16", "dtype of the exported weights (d2t stays int64, t2d bool)")
    embed_tokens: bool = doc(True, "ship embed_tokens [V, H] (required when H != Ht); false "
                             "saves V*H weights and engines share the target's")


# ----------------------------------------------------------------------------------------- evaluate
@dataclass
class EvalDatasetConfig:
    name: str = doc("", "name used in the report", user=True)
    path: str = doc("", "JSONL(.gz) file or builtin:humaneval", user=True)
    max_prompts: int | None = doc(None, "use the first N prompts", user=True)
    field: str | None = doc(None, "the record field holding the prompt (e.g. Instruction), as "
                            "prepare's sources take it")


@dataclass
class EvaluateConfig:
    datasets: list[EvalDatasetConfig] = doc(
        [EvalDatasetConfig(name="humaneval", path="builtin:humaneval", max_prompts=10)],
        "evaluation prompt sets")
    drafter: str = doc("export", "export (this run's native/), a checkpoint dir, or a native dir",
                       user=True)
    baseline: str | None = doc(None, "another drafter dir shown side by side")
    max_new_tokens: int = doc(128, "new tokens per prompt", user=True)
    methods: list[str] = doc(["chain"], "chain, tree and/or block (the chain verified as a "
                             "block at temperatures above 0)", user=True)
    k: int = doc(5, "chain: tokens drafted per step (EAGLE-3; a DSpark or DFlash drafter's "
                 "chain is its block)", user=True)
    tree_depth: int = doc(6, "tree: drafting depth", user=True)
    tree_topk: int = doc(8, "tree: children per node", user=True)
    tree_tokens: int = doc(48, "tree: total draft tokens verified per step", user=True)
    temperatures: list[float] = doc([0.0], "sampling temperatures (0 = greedy, lossless-checked)",
                                    user=True)
    seed: int = doc(0, "sampling seed")
    batch_size: int = doc(1, "prompts decoded together", user=True)
    continuous: bool = doc(True, "with more prompts than batch_size: a row whose answer has "
                           "ended takes the next prompt (continuous batching, as engines "
                           "serve); false: static batches, each until its slowest row ends")
    prefill_graph_tokens: int = doc(
        2048, "on a GPU: a batch's prefill of at most this many tokens (batch x prompts "
        "left-padded to a multiple of 64) replays a CUDA graph as the decoding steps do, one per "
        "length (small prefills are kernel launches, not GPU work); 0: eager prefills")
    tie_tolerance: float | None = doc(
        None, "lossless check: a greedy divergence to one of the plain run's 8 runners-up whose "
        "logit is at most this below the top is a numerical tie, not a failure; default 0 in "
        "float32, 0.5 in 16-bit (any other 16-bit mismatch is decoded again in float32)")
    engine: Literal["drafter", "vllm", "both"] = doc(
        "drafter", "who decodes: drafter's own evaluator (the target in transformers), vllm "
        "(the export served beside the target inside vLLM, tau from vLLM's own counters: "
        "targets beyond one GPU), or both side by side", user=True)
    run_recommended: bool = doc(
        True, "after the methods, also decode the setting the tuner recommends for batch_size "
        "at each evaluated temperature when none of them was it: its speedup measured, not only "
        "expected")


# -------------------------------------------------------------------------------------------- learn
@dataclass
class LearnConfig:
    """`drafter learn`: the target served in vLLM with a drafter that keeps learning from the
    requests it serves (docs/learn.md). Where clients connect: generate.server.host / port."""
    drafter: str = doc("export", "the drafter served at the first start: export (this run's "
                       "native/), or a native dir or checkpoint dir")
    sample_rate: float = doc(0.25, "share of served requests kept (prompt and answer tokens, "
                             "under RUN_DIR/learn/traffic) to train and judge drafters on")
    holdout: float = doc(0.25, "share of the kept requests held out to judge candidates, "
                         "never trained on")
    max_samples: int = doc(4096, "kept requests on disk at most; the oldest go first")
    max_age_hours: float = doc(168.0, "kept requests older than this are deleted")
    round_samples: int = doc(64, "new kept requests (training share) that start a round: a "
                             "candidate trained from the serving drafter on every kept one")
    eval_prompts: int = doc(32, "held-out requests (the newest) a candidate and the serving "
                            "drafter are both decoded on, at each request's temperature")


# --------------------------------------------------------------------------------------------- plan
@dataclass
class PlanConfig:
    """`drafter plan`: figures used when the run directory holds no measurement yet. Measured
    values (token files, earlier manifests' tokens/s) always win over these (docs/operations.md)."""
    samples: int | None = doc(None, "conversations expected when no prepare/tokenize output "
                              "exists yet; default: counted from the sources")
    tokens_per_sample: int | None = doc(None, "tokens per conversation (prompt + answer) when "
                                        "no tokenize output exists; default: estimated")
    answer_tokens_per_sample: int | None = doc(None, "tokens generate writes per conversation; "
                                               "default: generate.max_tokens (an upper bound)")
    gpus: int | None = doc(None, "GPUs the run uses (extract/train ranks, server tensor "
                           "parallel); default: the visible ones, else 1")
    gpu_memory_gib: float | None = doc(None, "memory per GPU in GiB; default: the smallest "
                                       "visible GPU's (H100: 79.6, H200: 139.8)")
    gpu_tflops: float = doc(989.0, "dense bf16 TFLOP/s per GPU for time estimates "
                            "(H100/H200 SXM: 989)")
    gpu_hbm_tbps: float = doc(4.8, "GPU memory bandwidth in TB/s for decode estimates "
                              "(H100: 3.35, H200: 4.8)")
    mfu: float = doc(0.3, "share of gpu_tflops reached by prefill (extract) and training")
    hbm_efficiency: float = doc(0.5, "share of gpu_hbm_tbps reached by decoding")
    load_gbps: float = doc(2.0, "GB/s at which target weights are read from disk (load time)")
    store_gbps: float = doc(0.5, "GB/s per GPU at which extract stores its features (copy to "
                            "the host, checksum, write), added to the forward's time")
    generate_tokens_per_s: float | None = doc(None, "generated tokens/s of the whole server; "
                                              "default: measured, else a bandwidth estimate")
    tokenize_tokens_per_s: float | None = doc(None, "tokens/s of tokenize (all workers); "
                                              "default: measured, else 50000 per worker")
    extract_tokens_per_s: float | None = doc(None, "extract tokens/s per GPU; default: "
                                             "measured, else a FLOP estimate")
    train_tokens_per_s: float | None = doc(None, "train tokens/s per GPU; default: measured, "
                                           "else a FLOP estimate")
    evaluate_tokens_per_s: float | None = doc(None, "evaluate decoded tokens/s; default: "
                                              "measured, else a bandwidth estimate")


# ---------------------------------------------------------------------------------------- top level
@dataclass
class Config:
    run_dir: str = doc("runs/quickstart", "the run directory: one folder per step", user=True)
    max_disk_gib: float | None = doc(
        None, "the run's disk budget (GiB): its data, extract's val and head, train's "
        "checkpoints, the export and the train split's features, which then pass a chunk of "
        "train's own steps at a time, each trained and deleted before the next; null stores "
        "every shard at once (docs/extract.md, Bounded disk)")
    target: TargetConfig = doc(TargetConfig(), "the target model")
    prepare: PrepareConfig = doc(PrepareConfig(), "prepare step")
    generate: GenerateConfig = doc(GenerateConfig(), "generate step")
    tokenize: TokenizeConfig = doc(TokenizeConfig(), "tokenize step")
    vocab: VocabConfig = doc(VocabConfig(), "vocab step")
    extract: ExtractConfig = doc(ExtractConfig(), "extract step")
    train: TrainConfig = doc(TrainConfig(), "train step")
    export: ExportConfig = doc(ExportConfig(), "export step")
    evaluate: EvaluateConfig = doc(EvaluateConfig(), "evaluate step")
    learn: LearnConfig = doc(LearnConfig(), "drafter learn: serve and keep learning")
    plan: PlanConfig = doc(PlanConfig(), "drafter plan: estimates used before any data exists")


# ------------------------------------------------------------------------------------- retired keys
# Keys that are no longer keys, and why (what drafter now always does), and values renamed: a
# config or an override that sets one fails with this line, naming its file:line, so that it is
# neither silently ignored nor read in another meaning.
REMOVED: dict[str, str] = {
    "train.gc_freeze": "train always freezes what is alive after its first step out of Python's "
                       "garbage collections (GcClock in drafter/train/trainer.py)",
    "train.loader_threads": "offline, LOADER_THREADS threads (drafter/train/trainer.py) always "
                            "build the micro-batches",
    "train.saved_graphs": "train always loads the pieces the precompile saved whole, and compiles "
                          "those that do not load (docs/train.md, Pieces loaded whole)",
    "extract.self_check": "extract always compares its capture with a plain forward on one sample "
                          "before the run",
    "extract.packing": "extract packs rows into one under flash attention and right-pads them "
                       "otherwise (what auto did)",
    "evaluate.cuda_graphs": "evaluate always replays its decoding steps from CUDA graphs on a GPU "
                            "(evaluate.prefill_graph_tokens=0 keeps prefills eager)",
}

# Keys that moved to another place (a config that sets the old one fails naming the new; a run
# dir's snapshot an older drafter wrote is read with the value moved): {old: (new, why)}.
MOVED: dict[str, tuple[str, str]] = {
    "extract.max_disk_gib": ("max_disk_gib", "the budget is the run's: data, val and head, "
                             "checkpoints, export and chunks within it"),
}

# One word for drafter's own code in this process, in every engine key (generate.server.engine:
# transformers is `transformers serve`, a server drafter starts).
OWN = "drafter's own code, in this process"
RENAMED: dict[tuple[str, str], tuple[str, str]] = {
    ("extract.engine", "transformers"): ("drafter", OWN),
    ("generate.server.engine", "local"): ("drafter", OWN),
}


# ------------------------------------------------------------------------------------- entry points
def load(path: str | Path | None = None, overrides: list[str] = (),
         validate: bool = True) -> Config:
    """Read a YAML config (or the defaults when path is None), apply dotted overrides, check
    types, then (`validate`) ranges and cross-field rules. `validate=False` reads a run dir's
    snapshot, which an older drafter may have written: retired keys are dropped there, where
    they are errors otherwise."""
    data: dict = {}
    where = Where(None, None)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config: {e.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line, what = not_utf8(raw, e)
            raise ConfigError(f"{path}:{line}: {what}: save the config as UTF-8 text") from None
        try:
            node = yaml.compose(text)
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f":{mark.line + 1}" if mark is not None else ""
            what = " ".join(str(x) for x in (getattr(e, "context", None),
                                             getattr(e, "problem", None)) if x) or str(e)
            raise ConfigError(f"{path}{at}: not valid YAML: {what}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        where = Where(str(path), node)
    cfg = build(Config, retire(data, REMOVED, RENAMED, where, validate, MOVED), "", where)
    for text in overrides:
        keys, value = parse_override(text)
        merged = apply_override(to_dict(cfg), keys, value, text)
        at = Where(f"override '{text}'", None)
        # Validate against the file's line table first, then name the override itself.
        try:
            cfg = build(Config, retire(merged, REMOVED, RENAMED, at, validate, MOVED), "", at)
        except ConfigError as e:
            raise ConfigError(str(e)) from None
        where.overrides[".".join(keys)] = text
    derive(cfg)
    if validate:
        check_values(cfg, where)
    cfg._where = where  # type: ignore[attr-defined]  (not a field: equality ignores it)
    return cfg


def where(cfg: Config, key: str) -> str:
    """'file:line' (or the override) that set a dotted key of a loaded config."""
    w = getattr(cfg, "_where", None)
    return w(key) if w is not None else "config"


def to_dict(obj) -> Any:
    """Plain dict/list/scalar view of a config (or any part of it)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(x) for x in obj]
    return obj


def section(cfg: Config, name: str) -> Any:
    return getattr(cfg, name)


def dump(cfg: Config) -> str:
    """The resolved config as YAML (what `drafter config` prints and each run stores)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None, width=100)


def fingerprint(obj) -> str:
    """Stable short hash of any config part."""
    import hashlib
    blob = json.dumps(to_dict(obj), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def help_lines(cls=Config, prefix: str = "",
               advanced: bool = True) -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field: the body of `--help`. `advanced=False`: only
    the keys users set (`doc(..., user=True)`) and the sections that hold them."""
    rows = _help_rows(cls, prefix)
    if advanced:
        return [(k, d, h) for k, d, h, _, _ in rows]
    shown = [k for k, _, _, user, header in rows if user and not header]
    return [(k, d, h) for k, d, h, user, header in rows
            if (user and not header) or (header and any(
                x.startswith((k + ".", k + "[")) for x in shown))]


def keys(advanced: bool = True) -> list[str]:
    """Every dotted config key (no sections); `advanced=False`: those users set."""
    return [k for k, _, _, user, header in _help_rows(Config, "")
            if not header and (advanced or user)]


def _help_rows(cls, prefix: str) -> list[tuple[str, str, str, bool, bool]]:
    """(dotted key, default, doc, user, is a section) for every field and section."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, help, user = f"{prefix}{f.name}", f.metadata.get("help", ""), f.metadata["user"]
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        opt = [a for a in typing.get_args(tp) if a is not type(None)] \
            if typing.get_origin(tp) in (typing.Union, types.UnionType) else []
        if len(opt) == 1 and dataclasses.is_dataclass(opt[0]):   # an optional section
            rows.append((key, "null", help, user, True))
            rows.extend(_help_rows(opt[0], key + "."))
            continue
        if dataclasses.is_dataclass(tp):
            rows.append((key, "", help, user, True))
            rows.extend(_help_rows(tp, key + "."))
            continue
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if item is not None and dataclasses.is_dataclass(item):
            rows.append((key, "[...]", help, user, True))
            rows.extend(_help_rows(item, key + "[]."))
            continue
        rows.append((key, json.dumps(to_dict(default)), help, user, False))
    return rows
