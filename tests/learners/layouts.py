"""Prompt/completion batches, one for each scoring layout `choose_layout` picks for the tiny test policy
(hidden size 64): distinct prompts pack into rows; groups of short completions take one grouped row per
prompt; groups whose row would pass the hidden size share their prompt's KV cache in a second pass."""

LAYOUT_EXAMPLES = {  # layout: (prompts, completions)
    "packed": ([[5, 6, 7, 8, 9], [6, 7], [8], [9, 10, 11]], [[10], [11, 12, 13], [5, 5, 5, 5], [7, 8]]),
    "grouped": ([[5, 6, 7, 8, 9] * 4] * 3 + [[6, 7] * 5] * 3, [[10], [11, 12], [13, 5, 5], [7], [8, 8], [9, 10, 11]]),
    "shared_prompt": ([[5, 6, 7, 8, 9] * 8] * 3 + [[6, 7] * 10] * 3,
                      [[10, 4, 4, 4, 4, 4, 4, 4, 4], [11, 12] * 4, [13, 5, 5] * 3, [7] * 9, [8, 8], [9, 10, 11]]),
}
