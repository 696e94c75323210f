from tests.engine.conftest import scene_images  # noqa: F401  (shared fixture)
