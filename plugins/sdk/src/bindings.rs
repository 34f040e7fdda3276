//! wit-bindgen output, one module per world. Each world's export macro is public so the
//! plugin crate (not the SDK) emits the exports; the SDK itself only carries imports.

pub mod reasoning {
    wit_bindgen::generate!({
        path: "../../wit/v0.3",
        world: "reasoning-parser-plugin",
        pub_export_macro: true,
        export_macro_name: "__export_reasoning_world",
        default_bindings_module: "k3_plugin_sdk::bindings::reasoning",
    });
}

pub mod tools {
    wit_bindgen::generate!({
        path: "../../wit/v0.3",
        world: "tool-parser-plugin",
        pub_export_macro: true,
        export_macro_name: "__export_tool_world",
        default_bindings_module: "k3_plugin_sdk::bindings::tools",
    });
}

pub mod template {
    wit_bindgen::generate!({
        path: "../../wit/v0.3",
        world: "chat-template-plugin",
        pub_export_macro: true,
        export_macro_name: "__export_template_world",
        default_bindings_module: "k3_plugin_sdk::bindings::template",
    });
}

pub mod router {
    wit_bindgen::generate!({
        path: "../../wit/v0.3",
        world: "router-plugin",
        pub_export_macro: true,
        export_macro_name: "__export_router_world",
        default_bindings_module: "k3_plugin_sdk::bindings::router",
    });
}

/// A tool parser that also exports `output-grammar` (WIT 0.3); its own crate (see there why).
pub use k3_plugin_sdk_tool_grammar::world as tools_grammar;
