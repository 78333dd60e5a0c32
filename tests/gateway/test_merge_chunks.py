"""gateway.types.merge_chunks: what a request's pipeline queued while its consumer wrote to a
slow client leaves in as few chunks as carry the same content, in order."""
from gateway.types import GatewayError, GenChunk, merge_chunks

END = object()


def test_plain_chunks_fold_into_the_next_which_keeps_its_end():
    usage, timings = {"prompt_tokens": 3}, {"total_ms": 9.0}
    got = merge_chunks([GenChunk([1], "a", ["l1"]), GenChunk([2], "b", ["l2"]),
                        GenChunk([3], "c", ["l3"], "stop", "x", usage, timings), END])
    assert got == [GenChunk([1, 2, 3], "abc", ["l1", "l2", "l3"], "stop", "x", usage, timings), END]


def test_first_token_timings_and_errors_stay_whole():
    first = GenChunk([7], "h", timings={"ttft_ms": 5.0})
    err = GatewayError(14, "gone")
    items = [first, GenChunk([8], "i"), GenChunk([9], "!"), err, END]
    got = merge_chunks(items)
    assert got[0] is first  # the first token's own chunk (its TTFT timing) is not delayed
    assert got[1] == GenChunk([8, 9], "i!")
    assert got[2:] == [err, END]


def test_one_item_or_none():
    c = GenChunk([1])
    assert merge_chunks([c]) == [c] and merge_chunks([]) == []
    assert sum(len(x.token_ids) for x in merge_chunks([GenChunk([i]) for i in range(50)])) == 50
