"""What serving engines load: the native and speculators layouts and their writers
(engines), reading any EAGLE-3 dir back (enginedir), and linting one (check) for the known
acceptance killers (rules) and for whether the installed vLLM / SGLang serves EAGLE-3 for the
target at all (support). The contract is docs/export.md."""
