"""What serving engines load: the native and speculators layouts and their writers
(engines), reading any EAGLE-3 dir back (enginedir), and linting one (check) for the known
acceptance killers (rules), for whether the installed vLLM / SGLang serves EAGLE-3 for the
target at all (support) and for whether its README's commands for sampled requests sample their
drafts (readme_check); what the drafter was trained with, in drafter.json, the README and a
rule (trained). The contract is docs/export.md."""
