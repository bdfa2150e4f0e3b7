from rest_framework.routers import SimpleRouter

from endpoints import api

router = SimpleRouter()
router.register("models", api.ModelCatalogViewSet, basename="model")
router.register("gpu-types", api.GPUCatalogViewSet, basename="gpu-type")

urlpatterns = router.urls
