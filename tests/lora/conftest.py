from tests.engine.conftest import scene_images  # noqa: F401 (the image fixture)
