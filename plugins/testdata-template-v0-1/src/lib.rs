//! TEST ONLY. A chat template built directly against `k3serve:plugin@0.1.0` (no SDK: the SDK
//! targets 0.2): minijinja with `raise_exception`, rendering to one string. The host must keep
//! loading it and apply the v0.1 rule (it taints client text around the render itself).

#[cfg(target_arch = "wasm32")]
mod component {
    wit_bindgen::generate!({
        path: "../../wit/v0.1",
        world: "chat-template-plugin",
    });

    use exports::k3serve::plugin::chat_template::{
        Guest as TemplateGuest, GuestTemplate, RenderOptions, TemplateError,
    };
    use k3serve::plugin::types::Stage;

    struct V01;

    struct Compiled(Result<minijinja::Environment<'static>, String>);

    fn raise(message: String) -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("raised: {message}"),
        ))
    }

    fn compile(source: &str) -> Result<minijinja::Environment<'static>, String> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise);
        env.add_template_owned("t", source.to_string())
            .map_err(|e| e.to_string())?;
        Ok(env)
    }

    fn json(s: &str) -> Result<minijinja::Value, TemplateError> {
        serde_json::from_str::<serde_json::Value>(s)
            .map(|v| minijinja::Value::from_serialize(&v))
            .map_err(|e| TemplateError::InvalidInput(e.to_string()))
    }

    fn render(
        env: &minijinja::Environment<'static>,
        messages: &str,
        tools: Option<&str>,
        o: &RenderOptions,
    ) -> Result<String, TemplateError> {
        let mut ctx = std::collections::BTreeMap::new();
        if let Some(extra) = &o.extra_kwargs_json
            && let Ok(serde_json::Value::Object(map)) = serde_json::from_str(extra)
        {
            for (k, v) in map {
                ctx.insert(k, minijinja::Value::from_serialize(&v));
            }
        }
        ctx.insert("messages".to_string(), json(messages)?);
        if let Some(t) = tools {
            ctx.insert("tools".to_string(), json(t)?);
        }
        ctx.insert(
            "add_generation_prompt".to_string(),
            o.add_generation_prompt.into(),
        );
        if let Some(t) = o.thinking {
            ctx.insert("thinking".to_string(), t.into());
        }
        let t = env
            .get_template("t")
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        t.render(minijinja::Value::from(ctx)).map_err(|e| {
            let m = e.to_string();
            match m.find("raised: ") {
                Some(i) => TemplateError::Raised(m[i + 8..].to_string()),
                None => TemplateError::Render(m),
            }
        })
    }

    impl GuestTemplate for Compiled {
        fn new(source: String) -> Self {
            Self(compile(&source))
        }
        fn check(&self) -> Result<(), TemplateError> {
            self.0
                .as_ref()
                .map(|_| ())
                .map_err(|e| TemplateError::Syntax(e.clone()))
        }
        fn render(
            &self,
            messages: String,
            tools: Option<String>,
            options: RenderOptions,
        ) -> Result<String, TemplateError> {
            let env = self
                .0
                .as_ref()
                .map_err(|e| TemplateError::Syntax(e.clone()))?;
            render(env, &messages, tools.as_deref(), &options)
        }
    }

    impl TemplateGuest for V01 {
        type Template = Compiled;
        fn render(
            source: String,
            messages: String,
            tools: Option<String>,
            options: RenderOptions,
        ) -> Result<String, TemplateError> {
            let env = compile(&source).map_err(TemplateError::Syntax)?;
            render(&env, &messages, tools.as_deref(), &options)
        }
    }

    impl Guest for V01 {
        fn metadata() -> PluginMetadata {
            PluginMetadata {
                name: "testdata-template-v0-1".into(),
                version: "0.1.0".into(),
                stage: Stage::ChatTemplate,
                wit_version: "0.1.0".into(),
                description: "TEST ONLY: a v0.1 chat template".into(),
            }
        }
        fn self_test() -> Result<(), String> {
            Ok(())
        }
    }

    export!(V01);
}
