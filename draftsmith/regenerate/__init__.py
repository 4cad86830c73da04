"""Stage regenerate_responses: replace the assistant turns of the training conversations with the
target's own answers, so the draft learns the distribution it will be asked to predict.

Conversations are read with ``draftsmith.conversations.load_conversations`` as regeneration reads
them: an empty assistant turn is one for the target to write, and a conversation that ends with a
user turn gets one after it, so a source of prompts alone is answered whole. Bad rows are counted
and skipped here, and more than data.max_bad_fraction of them stop the stage before the target
loads, as prepare_dataset would stop (it sees the regenerated rows only, where they are gone). They
are grouped into chunks of ``chunk_size`` conversations, and each chunk is regenerated turn by
turn: round r answers the r-th answer (an assistant turn after a user turn) of every conversation in
the chunk, conditioned on the original user turns, the row's tool definitions, any assistant turn
that opens the conversation, and the answers regenerated in earlier rounds.
A round runs as left-padded ``model.generate`` batches sorted by prompt length (``backend: hf``), or
as one ``LLM.generate`` call of vLLM's offline engine at full tensor parallelism (``backend: vllm``,
draftsmith.engines.vllm_generation); both return token ids, decoded here alike, up to the first stop
token and with the special tokens the target wrote inside its answer kept, so they write the same rows.
More than data.max_bad_fraction empty answers (nothing but whitespace) stop the stage naming the
target, since prepare_dataset would drop their conversations as bad data. Each finished chunk
is renamed into ``work_dir`` atomically, so a killed job resumes at the first missing chunk; a
fingerprint of the settings, the model, the sources and this code guards the chunks against reuse
under different conditions.

The package:

* ``settings``   RegenerateSettings: the config's regenerate section and the target's engine
* ``answering``  the target answering the turns of conversations (``Regenerator``: transformers'
                 ``generate``; ``VllmRegenerator``), opened on a loaded target by ``open_regenerators``,
                 and the judgement of what it wrote (``check_answers``); synthesis answers through it too
* ``stage``      ``regenerate_responses``: the chunks, their fingerprint, the output and its stats

Nothing is imported here.
"""
