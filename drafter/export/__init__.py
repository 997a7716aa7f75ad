"""What serving engines load: the native and speculators layouts of an EAGLE-3 drafter and their
writers (engines), a block drafter's (DSpark, DFlash) native layout and its writer (dsparkdir),
reading any such dir back (enginedir), and linting one (check) for the known acceptance killers
(rules; block dirs: dspark_rules), for whether the installed vLLM / SGLang serves EAGLE-3 for the
target at all (support) and for whether its README's commands for sampled requests sample their
drafts (readme_check); what the drafter was trained with, in drafter.json, the README and a
rule (trained). The contract is docs/export.md."""
