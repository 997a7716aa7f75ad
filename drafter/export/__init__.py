"""What serving engines load: the native and speculators layouts and their writers
(engines), reading any EAGLE-3 dir back (enginedir), and linting one for the known acceptance
killers (check). The contract is docs/export.md."""
