"""DeepEP's `Config`: what one dispatch or combine runs with (here only its SM count)."""

from .checks import sms_count


class Config:
    """
    DeepEP's `Config` (`deep_ep.Config`): what one dispatch or combine runs with. Only `num_sms` is read here (pass
    the config as `Buffer.dispatch(..., config=...)` / `Buffer.combine(..., config=...)`); the chunk sizes tune
    DeepEP's ring buffers, which these transports do not have, and are kept only for code that reads them back.

    Arguments:
        num_sms: the SMs (persistent programs) of the call's communication kernels, an int >= 1 (DeepEP's must be
            even; any count works here). DeepEP's own `deep_ep.Config` does not expose its count to Python: passed
            here it gives the buffer's `num_sms`.
        num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens,
        num_max_rdma_chunked_recv_tokens: accepted and kept (DeepEP's chunking of its NVLink and RDMA buffers).
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = sms_count("num_sms", num_sms)
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0. DeepEP sizes a ring buffer from the chunk sizes; the device backends here hold a whole dispatch, so
        their size follows the token count: `Buffer.get_buffer_size_hint(num_max_tokens_per_rank, hidden, num_ranks,
        num_topk, backend=...)`. With 0 bytes a `Buffer` runs the reference backend, and a device backend refuses
        the size with that advice."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: the hierarchical transport sizes its messages per call (no RDMA buffer to size)."""
        return 0

    def __repr__(self) -> str:
        return f"Config(num_sms={self.num_sms})"
