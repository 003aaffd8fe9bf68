// Our compatibility shim for building ggml's Vulkan backend against Vulkan headers older
// than VK_EXT_layer_settings (Debian 12 ships 1.3.239): ggml always chains a
// VkLayerSettingsCreateInfoEXT into instance creation (the settings are only read when
// the validation layer is on). These are the extension's C layouts under the vulkan.hpp
// names ggml uses; with newer headers this file defines nothing.
#pragma once
#include <cstdint>
#include <vector>
#include <vulkan/vulkan_core.h>

#ifndef VK_EXT_layer_settings
namespace vk {
enum class LayerSettingTypeEXT : int32_t { eBool32 = 0, eInt32 = 1, eInt64 = 2, eUint32 = 3, eUint64 = 4, eFloat32 = 5, eFloat64 = 6, eString = 7 };

struct LayerSettingEXT {
    const char* pLayerName;
    const char* pSettingName;
    LayerSettingTypeEXT type;
    uint32_t valueCount;
    const void* pValues;
};

struct LayerSettingsCreateInfoEXT {
    int32_t sType = 1000496000;  // VK_STRUCTURE_TYPE_LAYER_SETTINGS_CREATE_INFO_EXT
    const void* pNext = nullptr;
    uint32_t settingCount = 0;
    const LayerSettingEXT* pSettings = nullptr;

    explicit LayerSettingsCreateInfoEXT(const std::vector<LayerSettingEXT>& settings)
        : settingCount(static_cast<uint32_t>(settings.size())), pSettings(settings.data()) {}
};
}  // namespace vk
#endif
