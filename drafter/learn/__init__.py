"""`drafter learn`, above the steps: the target served in vLLM with a drafter that keeps
learning from the requests it serves (docs/learn.md). The command and its main loop (command),
the served engine and its in-place drafter swaps (engine), the front clients reach, which keeps
a share of the requests (front), the kept requests on disk and their retention (traffic), the
drafter versions, the serving record and the swap history (versions), the rounds that train
candidates beside serving (learner), and a candidate judged against the serving drafter on
held-out traffic (judge)."""
