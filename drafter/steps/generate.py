"""The generate step (see ../shared/docs/DESIGN.md). Not implemented yet."""


def main(cfg) -> dict:
    raise NotImplementedError("drafter generate: not implemented yet")
