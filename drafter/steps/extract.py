"""The extract step (see ../shared/docs/DESIGN.md). Not implemented yet."""


def main(cfg) -> dict:
    raise NotImplementedError("drafter extract: not implemented yet")
