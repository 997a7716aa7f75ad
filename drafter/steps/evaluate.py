"""The evaluate step (see ../shared/docs/DESIGN.md). Not implemented yet."""


def main(cfg) -> dict:
    raise NotImplementedError("drafter evaluate: not implemented yet")
