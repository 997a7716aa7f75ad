"""The run machinery above the steps: step order, skip and stale logic and the engine
lifecycle between steps (pipeline), the plan made before any weights load (plan, counts), the
checks a config gets before a step touches the run dir (preflight), and the machine check
(doctor)."""
