"""Foundations every other package stands on: the typed config (config), the only code that
knows run-directory paths and writes atomically (rundir), the torchrun environment (dist), the GPUs
and who holds them (gpu), and the target model loaded the one way (target). Imports nothing of
drafter but drafter.DrafterError."""
