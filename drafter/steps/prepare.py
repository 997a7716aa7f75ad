"""The prepare step (see ../shared/docs/DESIGN.md). Not implemented yet."""


def main(cfg) -> dict:
    raise NotImplementedError("drafter prepare: not implemented yet")
