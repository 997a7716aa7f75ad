"""The run machinery above the steps: step order, skip and stale logic (pipeline), one process
per run dir and the signals that stop it (lifecycle), the wait for generate's GPU memory between
steps (gpu_release), the plan made before any weights load (plan, counts, and its chunks:
chunkplan), the checks a config
gets before a step touches the run dir (preflight), who makes the chunks of a run with a disk
budget (chunked), and the machine check (doctor)."""
