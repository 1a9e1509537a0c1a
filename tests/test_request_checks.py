"""What a worker takes of a checked request (services/worker/request_checks.py): the prompt's
block chain completed from the lead the sender brought, and a lead hashed another way refused."""

from __future__ import annotations

import pytest

from services.contract.errors import RequestError
from services.contract.messages import DecodeRequest, PrefillRequest
from services.contract.prefix import block_hashes_reference
from services.worker.request_checks import check_decode, check_prefill

BLOCK = 64
VOCAB = 1000
PROMPT = [(7 * i + 3) % VOCAB for i in range(3 * BLOCK + 5)]  # 3 full blocks and a tail


@pytest.mark.parametrize("lead", [0, 1, 3])
def test_the_chain_covers_every_full_block_whatever_lead_the_sender_brought(lead: int) -> None:
    chain = block_hashes_reference(PROMPT, BLOCK)
    prefill = PrefillRequest(request_id="r", prompt=PROMPT, decode_worker="d",
                             hashes=chain[:lead])
    decode = DecodeRequest(request_id="r", prompt=PROMPT, hashes=chain[:lead])
    assert check_prefill(prefill, VOCAB, BLOCK, max_lanes=1).hashes == chain
    assert check_decode(decode, VOCAB, BLOCK).hashes == chain


def test_a_lead_hashed_another_way_is_refused() -> None:
    shifted = block_hashes_reference(PROMPT[1:], BLOCK)[:2]
    with pytest.raises(RequestError, match="hashes"):
        check_decode(DecodeRequest(request_id="r", prompt=PROMPT, hashes=shifted), VOCAB, BLOCK)
