"""Single-token state update (cached decoding): longctx decodes hybrid models by full
forwards, so the stand-in refuses it."""


def selective_state_update(*args, **kwargs):
    raise NotImplementedError("stand-in: cached decoding is not used by longctx")
