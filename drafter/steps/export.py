"""The export step (see ../shared/docs/DESIGN.md). Not implemented yet."""


def main(cfg) -> dict:
    raise NotImplementedError("drafter export: not implemented yet")
