"""The embedded world (SPEC §7): a seeded image-text world with exact ground truth, exported in the
real formats (COCO captions, Karpathy, VQA v2, Flickr30K Entities, CoNLL-U) so that the readers of
real data sets serve it too.

    scene.py      objects, boxes, occlusion; `scenes.jsonl` reader
    render.py     pixels
    relations.py  spatial relations and unique referring descriptors
    grammar.py    captions with entity chains and gold Stanford-dependency parses
    questions.py  VQA questions with ten noisy annotator answers
    export.py     the real formats
    build.py      `build_world`: everything into one directory, atomically
"""
